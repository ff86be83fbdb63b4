#!/usr/bin/env bash
# Device side of tools/gpu/diag_kv.py: stash the pieces (.gpu/dg/*), then join and run.
set -euo pipefail
S=/tmp/dg REPO=$PWD OUT=${OUT:-/tmp/dg/out}
mkdir -p "$S" "$OUT"; cp .gpu/dg/* "$S/" 2>/dev/null || true; ls "$S"
[ "${1:-}" = stash ] && exit 0
cd "$S"
if [ ! -d ortgpu ]; then cat ort-* | xz -dc | tar -x; tar -xJf bundle.tar.xz; fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$S/pkg" "$REPO" 2>&1 | grep -vi warning || true
echo "ready at $SECONDS s"
PYTHONPATH=$S/ortgpu:$S/pkg:$S/extra timeout "${2:-150}" python3 -u "$REPO/tools/gpu/diag_kv.py" "$S/demo-fp16" "$OUT" 2>&1 | grep -v "ScatterND\|CleanUnused\|Removing init" || true
