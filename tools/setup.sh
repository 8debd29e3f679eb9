#!/usr/bin/env bash
# Idempotent set-up of everything Regatta needs on a fresh Debian machine:
#   bash tools/setup.sh            (called by `make setup`, `make demo`, `make test`)
# Installs OpenMPI and PostgreSQL (Debian; the tests start a throwaway PostgreSQL
# cluster of their own, the packaged service is never used), a virtualenv in .venv,
# torch 2.13.0 CPU, mpi4py, Horovod 0.28.1 built from its sdist with the C++17 change
# (see ../shared/DESIGN.md) and our two patches (tools/horovod-*.patch), and the project
# itself. A built Horovod wheel is cached outside the checkout, keyed by Horovod, torch and
# Python versions and the patches, so a second set-up takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0
VENV=${REGATTA_VENV:-.venv}
CACHE=${REGATTA_CACHE:-$HOME/.cache/regatta}
STAMP=$VENV/.regatta-setup-done

step() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

need_apt=()
command -v mpirun >/dev/null || need_apt+=(openmpi-bin)
[ -f /usr/include/x86_64-linux-gnu/openmpi/mpi.h ] || [ -n "$(ls /usr/lib/*/openmpi/include/mpi.h 2>/dev/null)" ] || need_apt+=(libopenmpi-dev)
command -v cmake >/dev/null || need_apt+=(cmake)
command -v patch >/dev/null || need_apt+=(patch)
command -v chromium >/dev/null || need_apt+=(chromium)
# Simulated hosts in network namespaces (regatta local): ip and tc, unshare and nsenter.
command -v tc >/dev/null || need_apt+=(iproute2)
command -v nsenter >/dev/null || need_apt+=(util-linux)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_apt+=(postgresql)
# A real Slurm for tests/test_slurm.py (started there in namespaces, never as a service).
command -v slurmctld >/dev/null || [ -x /usr/sbin/slurmctld ] || need_apt+=(slurmctld)
command -v slurmd >/dev/null || [ -x /usr/sbin/slurmd ] || need_apt+=(slurmd)
command -v sbatch >/dev/null || need_apt+=(slurm-client)
command -v munged >/dev/null || [ -x /usr/sbin/munged ] || need_apt+=(munge)
if [ ${#need_apt[@]} -gt 0 ]; then
  step "apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${need_apt[@]}"
fi

if [ ! -x "$VENV/bin/python" ]; then
  step "virtualenv $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip wheel setuptools
fi
PY=$VENV/bin/python
PIP="$PY -m pip"

# Our patches to Horovod, each saying why at its top.
PATCHES="tools/horovod-wake-on-enqueue.patch tools/horovod-fixed-parameters-on-reinit.patch"
fresh=1
for file in pyproject.toml tools/setup.sh $PATCHES; do
  [ -f "$STAMP" ] && [ "$STAMP" -nt "$file" ] || fresh=0
done
[ "$fresh" = 1 ] && exit 0

if ! $PY -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  step "torch $TORCH_VERSION (CPU, from the machine's disk when it is there)"
  $PIP install --progress-bar on "torch==$TORCH_VERSION"
fi

PYTAG=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
# The recipe below, our patches included: a changed patch builds a new wheel, and a venv
# whose Horovod came from another recipe gets this one's.
RECIPE=horovod-$HOROVOD_VERSION-torch$TORCH_VERSION-$PYTAG-nodebug-patches$(cat $PATCHES | sha256sum | cut -c1-8)
WHEELDIR=$CACHE/$RECIPE
if ! $PY -c "import horovod.torch" 2>/dev/null || [ "$(cat "$VENV/.horovod-recipe" 2>/dev/null)" != "$RECIPE" ]; then
  if ! ls "$WHEELDIR"/horovod-*.whl >/dev/null 2>&1; then
    step "building Horovod $HOROVOD_VERSION (several minutes on two cores; cached in $WHEELDIR)"
    $PIP install -q cloudpickle psutil pyyaml packaging cffi
    build=$(mktemp -d)
    $PIP download -q --no-deps --no-binary :all: -d "$build" "horovod==$HOROVOD_VERSION"
    tar -xzf "$build"/horovod-$HOROVOD_VERSION.tar.gz -C "$build"
    src=$build/horovod-$HOROVOD_VERSION
    # Current torch headers need C++17; upstream made this change after 0.28.1.
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
      "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt"
    # Horovod builds RelWithDebInfo at -O3 with -g: debug symbols for every torch header
    # take a third of the build on two cores (3.5 -> 2.3 min) and 19 of the wheel's 20 MB;
    # the machine code is the same (-O3 -DNDEBUG either way).
    sed -i 's/string(REPLACE "-O2" "-O3" CMAKE_\(C\|CXX\)_FLAGS_RELWITHDEBINFO/string(REPLACE "-O2 -g" "-O3" CMAKE_\1_FLAGS_RELWITHDEBINFO/' \
      "$src/CMakeLists.txt"
    [ "$(grep -c 'REPLACE "-O2 -g" "-O3"' "$src/CMakeLists.txt")" = 2 ]
    # A queued tensor wakes Horovod's loop instead of waiting out its cycle; an elastic
    # reset keeps the fusion threshold and cycle the environment fixed.
    for file in $PATCHES; do patch -d "$src" -p1 --quiet < "$file"; done
    # Newer toolchains (a newer GCC and CMake 4, seen on a CUDA 13 machine): Horovod's headers
    # leave out standard includes that older libstdc++ pulled in (<string> in group_table.h,
    # <stdexcept> in common.h), so they are forced into every file; CMake 4 refuses
    # third_party/gloo's 2.8.12 minimum unless told which policies to assume.
    export CXXFLAGS="${CXXFLAGS:-} -include cstdint -include string -include stdexcept -include memory -include limits -include algorithm -include functional" \
      CMAKE_POLICY_VERSION_MINIMUM=3.5
    mkdir -p "$WHEELDIR"
    # Build output goes to a log; a dot a minute shows it is alive.
    ( while sleep 60; do printf '.'; done ) & ticker=$!
    trap 'kill $ticker 2>/dev/null || true' EXIT
    if ! env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        MAKEFLAGS=-j"$(nproc)" HOROVOD_BUILD_ARCH_FLAGS="" \
        $PIP wheel --no-deps --no-build-isolation -w "$WHEELDIR" "$src" >"$build/build.log" 2>&1; then
      kill $ticker 2>/dev/null || true
      tail -n 60 "$build/build.log"; echo "Horovod build failed; full log: $build/build.log" >&2
      exit 1
    fi
    kill $ticker 2>/dev/null || true
    echo
  fi
  step "installing cached Horovod wheel"
  $PIP install -q --no-deps --force-reinstall "$WHEELDIR"/horovod-*.whl
  echo "$RECIPE" > "$VENV/.horovod-recipe"
  $PIP install -q cloudpickle psutil pyyaml packaging cffi
fi

step "project and its dependencies"
$PIP install -q -e ".[test]"
"$VENV/bin/horovodrun" --check-build
touch "$STAMP"
