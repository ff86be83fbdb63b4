#!/usr/bin/env bash
# tools/gpu/diag_kv.py on the device machine, in four calls: a short diagnostic of float16
# decoding on CUDA that needs no transformers and no SmolLM2, so it fits a slot's last minutes.
#
# Here, once (the stage of a pack.py dry run holds ortgpu/ and site/):
#   tar -cf - -C STAGE ortgpu | xz -T2 -6 > /tmp/ortgpu.tar.xz && split -b 56M -d -a 1 /tmp/ortgpu.tar.xz .gpu/dg/ort-
#   specdec-export --target models/demo/target --draft models/demo/draft --dtype float16 --max-seq-len 512 --out /tmp/demo-fp16
#   mkdir /tmp/extra && cp -r STAGE/site/blake3* STAGE/site/tokenizers* /tmp/extra/
#   tar -cJf .gpu/dg/bundle.tar.xz -C /tmp demo-fp16 extra
# There (slim tree: tools/gpu/slim.sh on), one call per piece, carrying it:
#   tools/gpu/diag.sh stash                  # .gpu/dg/ort-0, ort-1, ort-2
#   tools/gpu/diag.sh run 100                # .gpu/dg/ort-3 and .gpu/dg/bundle.tar.xz: diag.jsonl in $OUT
set -euo pipefail
S=/tmp/dg REPO=$PWD OUT=${OUT:-/tmp/dg/out}
mkdir -p "$S" "$OUT"; cp .gpu/dg/* "$S/" 2>/dev/null || true; ls "$S"
[ "${1:-}" = stash ] && exit 0
cd "$S"
if [ ! -d ortgpu ]; then cat ort-* | xz -dc | tar -x; tar -xJf bundle.tar.xz; fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$S/pkg" "$REPO" 2>&1 | grep -vi warning || true
echo "ready at $SECONDS s"
PYTHONPATH=$S/ortgpu:$S/pkg:$S/extra timeout "${2:-150}" python3 -u "$REPO/tools/gpu/diag_kv.py" "$S/demo-fp16" "$OUT" 2>&1 | grep -v "ScatterND\|CleanUnused\|Removing init" || true
