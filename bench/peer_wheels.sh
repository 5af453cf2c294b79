#!/usr/bin/env bash
# The peers' wheels for a GPU window: the pinned Liger-Kernel and Cut Cross-Entropy
# (bench/gpu_window.py's PEER_WHEELS) downloaded, without their dependencies, into the
# git-ignored .whl/ folder, for the GPU machine, which has no network. A device call names
# `.whl` in its carry list; bench/gpu_window.sh (and gpu_check.sh) install them from there
# with `pip install --no-index --no-deps --target`, beside the machine's own torch and triton.
#
#   bash bench/peer_wheels.sh [--dest DIR] [--check]
#
# --dest DIR  where the wheels go (default .whl at the checkout's root)
# --check     download nothing: exit 0 if DIR holds exactly the pinned wheels, else 1
# Environment: PYTHON (default python3), whose pip downloads.
#
# Both are pure-Python wheels (py3-none-any): the same files serve the GPU machine's Python
# 3.12 and the CPU dry run's 3.11. Their dependencies (torch, triton) are the machine's.
set -eu -o pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=.whl
CHECK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dest) DEST=${2:?--dest needs a folder}; shift 2 ;;
    --dest=*) DEST=${1#--dest=}; shift ;;
    --check) CHECK=1; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "peer_wheels.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

# "name==version" per line, from the one place the versions are pinned.
PINS=$("$PY" -c 'import sys; sys.path.insert(0, "."); from bench.gpu_window import PEER_WHEELS
print("\n".join(f"{k}=={v}" for k, v in PEER_WHEELS.items()))')

wheel_of() {  # the file name a pin downloads to: name with "-" as "_", then the version
  local name=${1%%==*} version=${1##*==}
  echo "${name//-/_}-${version}-py3-none-any.whl"
}

missing=0
for pin in $PINS; do
  [ -f "$DEST/$(wheel_of "$pin")" ] || missing=1
done
if [ "$CHECK" = 1 ]; then
  [ "$missing" = 0 ] && echo "peer_wheels.sh: $DEST holds $(echo $PINS)" && exit 0
  echo "peer_wheels.sh: $DEST lacks some of $(echo $PINS)" >&2
  exit 1
fi

mkdir -p "$DEST"
for pin in $PINS; do
  name=${pin%%==*}
  # one version of each: a stale one beside the pinned one would stop the install there
  for old in "$DEST/${name//-/_}"-*.whl; do
    [ -e "$old" ] && [ "$(basename "$old")" != "$(wheel_of "$pin")" ] && rm -f "$old"
  done
  [ -f "$DEST/$(wheel_of "$pin")" ] && continue
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --dest "$DEST" "$pin"
done
for pin in $PINS; do
  f="$DEST/$(wheel_of "$pin")"
  [ -f "$f" ] || { echo "peer_wheels.sh: $pin did not download as $f" >&2; exit 1; }
  echo "$f ($(du -k "$f" | cut -f1) KiB)"
done
