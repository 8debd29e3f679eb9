#!/bin/sh
# Host discovery for `horovodrun --host-discovery-script` inside a Slurm allocation:
# prints `HOST:SLOTS` for each node of this job that Slurm says is usable. A node that is
# DOWN, DRAINED or DRAINING, FAILING, in MAINTENANCE, or not responding (`*`) is left out,
# so `scontrol update nodename=N state=drain` takes N out of the elastic world (Horovod
# sees a removed host: the others go on without a restart).
#
#   horovodrun -np "$SLURM_JOB_NUM_NODES" --min-np 1 --max-np "$SLURM_JOB_NUM_NODES" \
#       --host-discovery-script hostfiles/slurm_discover.sh python train.py
#
# SLOTS is $REGATTA_SLOTS_PER_NODE, else $SLURM_NTASKS_PER_NODE, else 1. Outside a job, or
# when Slurm cannot be asked, the script fails saying why (Horovod then keeps the last
# good list).
nodes=${1:-${SLURM_JOB_NODELIST:-}}
[ -n "$nodes" ] || { echo "slurm_discover.sh: no SLURM_JOB_NODELIST: run inside a Slurm job (or pass a node list)" >&2; exit 2; }
slots=${REGATTA_SLOTS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-1}}
case $slots in ''|*[!0-9]*|0) echo "slurm_discover.sh: slots per node must be a positive integer, got '$slots'" >&2; exit 2 ;; esac
states=$(sinfo --noheader --Node --nodes="$nodes" --format="%N %t") || {
  echo "slurm_discover.sh: sinfo failed for nodes $nodes" >&2; exit 1; }
printf '%s\n' "$states" | awk -v slots="$slots" '
  NF != 2 { printf "slurm_discover.sh: unexpected sinfo line %s\n", "\047" $0 "\047" > "/dev/stderr"; bad = 1; exit 1 }
  $2 ~ /\*$/ { next }                                       # not responding
  $2 ~ /^(down|drain|drng|drained|fail|failg|maint|boot|powered_down|powering_down|futr|inval)/ { next }
  !seen[$1]++ { print $1 ":" slots }
  END { if (bad) exit 1 }'
