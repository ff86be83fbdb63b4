#!/usr/bin/env bash
# The GPU check, on the device machine (or here, as a dry run with --provider cpu).
#
#   tools/gpu/check.sh --stash           # a piece call: keep .gpu/part-* outside the repo
#   tools/gpu/check.sh --unpack-only     # join, check and unpack the pieces, install this tree: for
#                                        # tools/gpu/drafter.py (docs/training-drafters.md)
#   tools/gpu/check.sh --export-early    # the same, then, once the pieces so far hold the GGUF,
#                                        # start the exports detached while the rest travels
#   tools/gpu/check.sh [--provider cuda|cuda-graph|cpu] [--budget SECONDS] [--quick] [--bundles a,b] [--stages exact,speed]
#
# The last form joins every piece stashed (tools/gpu/pack.py made them), checks the payload's
# sha256, unpacks it, installs this tree into the stage (no network, no dependencies: the image
# has the rest), and runs tools/gpu/check.py, which writes results.json to $OUT after every
# stage (the device tool brings $OUT back). docs/gpu.md gives the procedure.
set -euo pipefail
STAGE=${SPECDEC_GPU_STAGE:-/tmp/specdec-gpu}
OUT=${OUT:-$STAGE/out}
REPO=$PWD
mode=check provider=cuda budget=420 quick=() bundles=() stages=()
while [ $# -gt 0 ]; do
  case $1 in
    --stash) mode=stash ;;
    --unpack-only) mode=unpack ;;
    --export-early) mode=early ;;
    --provider) provider=$2; shift ;;
    --budget) budget=$2; shift ;;
    --quick) quick=(--quick) ;;
    --bundles) bundles=(--bundles "$2"); shift ;;
    --stages) stages=(--stages "$2"); shift ;;
    *) echo "check.sh: unknown option $1; see the header of tools/gpu/check.sh" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$STAGE/parts" "$STAGE/work" "$OUT"
PIECES=${SPECDEC_GPU_PIECES:-.gpu}  # where pack.py --out put them (.gpu-drafter for a drafter run)
if compgen -G "$PIECES/part-*" >/dev/null; then cp "$PIECES"/part-* "$STAGE/parts/"; fi
for f in payload.sha256 gguf.size prebuilt.txt; do if [ -f "$PIECES/$f" ]; then cp "$PIECES/$f" "$STAGE/"; fi; done
ls -l "$STAGE/parts"
GGUF="$STAGE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
args=(--provider "$provider" --out "$OUT" --models "$STAGE/models" --gguf "$GGUF" --work "$STAGE/work" "${quick[@]}" "${bundles[@]}" "${stages[@]}")

install() {  # this tree into the stage (once); the models are read from the payload's copy, in the
  # stage: the device tool mirrors the tree on every call, so files put into the slim tree's
  # models/ would vanish under a running export
  if [ ! -f "$STAGE/installed" ]; then
    PYTHONPATH="$STAGE/site" python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target "$STAGE/pkg" . 2>&1 | grep -v -i warning || true
    touch "$STAGE/installed"
  fi
}

case $mode in
  stash) exit 0 ;;
  early)
    [ -f "$STAGE/work/started" ] && { echo "exports already started"; exit 0; }
    # the pieces so far are a prefix of the xz stream: unpack the members it holds whole
    (cat "$STAGE"/parts/part-* | xz -dc 2>/dev/null | tar -x -C "$STAGE" 2>/dev/null) || true
    rm -rf "$STAGE/ortgpu"  # cut short here; the full unpack writes it, and the bundles sent whole
    if [ -f "$STAGE/prebuilt.txt" ]; then while read -r n; do rm -rf "$STAGE/work/$n" "$STAGE/work/$n.done"; done < "$STAGE/prebuilt.txt"; fi
    if [ "$(stat -c %s "$GGUF" 2>/dev/null || echo 0)" != "$(cat "$STAGE/gguf.size")" ]; then
      rm -rf "$STAGE/site" "$STAGE/models" "$STAGE/gguf"
      echo "the GGUF is not whole yet; send more pieces"; exit 0
    fi
    install
    cd "$STAGE/work"  # not the repo root: its specdec/ folder is not the installed package
    touch started
    PYTHONPATH="$STAGE/site:$STAGE/pkg" setsid nohup python3 "$REPO/tools/gpu/check.py" --exports-only "${args[@]}" > exports.log 2>&1 < /dev/null &
    echo "exports started"; exit 0 ;;
esac

t0=$(date +%s)
if [ ! -f "$STAGE/unpacked" ]; then
  cat "$STAGE"/parts/part-* > "$STAGE/payload.tar.xz"
  (cd "$STAGE" && sha256sum -c payload.sha256)
  tar -xJf "$STAGE/payload.tar.xz" -C "$STAGE" --skip-old-files  # an early unpack's files stay: exports may be reading them
  rm "$STAGE/payload.tar.xz"
  touch "$STAGE/unpacked"
fi
install
echo "unpacked and installed in $(( $(date +%s) - t0 )) s"
[ "$mode" = unpack ] && exit 0
cd "$STAGE/work"
PYTHONPATH="$STAGE/ortgpu:$STAGE/site:$STAGE/pkg" python3 -u "$REPO/tools/gpu/check.py" --budget "$budget" "${args[@]}" 2>&1 | tee "$OUT/log.txt"
