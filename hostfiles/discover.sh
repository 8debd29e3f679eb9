#!/bin/sh
# Host discovery for `horovodrun --host-discovery-script`: prints the hosts listed in a
# plain file, one `HOST` or `HOST:SLOTS` per line (# comments and blank lines ignored).
# An operator adds or removes a host by editing one line of that file.
#
#   horovodrun --min-np 2 --max-np 8 \
#       --host-discovery-script "hostfiles/discover.sh hostfiles/hosts.txt" python -m jobs.digits
#
# A malformed line makes the script fail with a message naming the file and line, so a
# typo never silently shrinks the job (Horovod keeps the last good host list meanwhile).
file=${1:-${REGATTA_HOSTS_FILE:-}}
[ -n "$file" ] || { echo "discover.sh: usage: discover.sh HOSTS_FILE" >&2; exit 2; }
[ -r "$file" ] || { echo "discover.sh: cannot read hosts file '$file'" >&2; exit 2; }
exec awk -v file="$file" '
  { sub(/#.*/, ""); gsub(/^[ \t]+|[ \t]+$/, "") }
  $0 == "" { next }
  $0 !~ /^[A-Za-z0-9._-]+(:[1-9][0-9]*)?$/ {
    printf "discover.sh: %s:%d: %s is not HOST or HOST:SLOTS\n", file, NR, "\047" $0 "\047" > "/dev/stderr"
    bad = 1; exit 1
  }
  { out = out (index($0, ":") ? $0 : $0 ":1") "\n" }
  END { if (bad) exit 1; printf "%s", out }
' "$file"
