#!/usr/bin/env bash
# Move the working tree's large files aside before a device call, and back after it.
#
#   bash bench/device_pack.sh out    # before `run`: the tree that travels drops to ~34 MB
#   bash bench/device_pack.sh back   # after the last call (always: the files are tracked)
#
# The device copies the working tree (tracked + untracked-not-ignored files) and takes at
# most 64 MiB; the SmolLM2 assets, data/ and the CPU results are ~130 MB.  Tests that need
# them skip there.  The tiny models' drafters and n-gram table stay: the CUDA tests of dflash,
# d2sd and diffuspec load them (packing them too skips 26 tests there).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STASH=${DSPEC_DEVICE_STASH:-/tmp/dspec_device_stash}
LARGE=(
  dspec/assets/drafters/smollm2-135m-dflash
  dspec/assets/drafters/smollm2-135m-vp
  dspec/assets/ngram/smollm2-135m-selfgen.npz
  dspec/assets/smollm2-135m-bd
  data
  bench/results/cpu
)
# move_all FROM TO: every LARGE path under FROM to the same path under TO (none overwritten)
move_all() {
  local from=$1 to=$2 p
  for p in "${LARGE[@]}"; do
    [ -e "$from/$p" ] || continue
    if [ -e "$to/$p" ]; then echo "device_pack: $to/$p exists: resolve by hand" >&2; exit 1; fi
    mkdir -p "$to/$(dirname "$p")"
    mv "$from/$p" "$to/$p"
  done
}
case ${1:-} in
  out)
    move_all . "$STASH"
    echo "moved to $STASH; travelling: $(git ls-files -z | xargs -0 du -ck 2>/dev/null | tail -1 | cut -f1) KiB tracked"
    ;;
  back)
    move_all "$STASH" .
    git status --short | grep '^ D' && { echo "device_pack: tracked files still missing" >&2; exit 1; }
    echo "restored"
    ;;
  *)
    echo "usage: bash bench/device_pack.sh out|back" >&2; exit 2 ;;
esac
