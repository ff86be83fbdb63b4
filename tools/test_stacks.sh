#!/usr/bin/env bash
# The tests on the other transformers major: 4.57 (the README's test command runs the suite on the
# newest transformers the `test` extra allows, 5.24 when written). A venv over this environment's
# packages, with only transformers (and what it needs) replaced; test bundles are cached per
# version (tests/bundles.py keys them by it). Run at every release (docs/export.md says why not in CI).
#
#   tools/test_stacks.sh                                   # tests/export on 4.57.6 (the export/validation tests)
#   tools/test_stacks.sh tests                             # the whole suite on 4.57.6
#   TRANSFORMERS=5.24.0 tools/test_stacks.sh tests/export/test_gguf.py -k peers
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${TRANSFORMERS:-4.57.6}
VENV=.venvs/transformers-$VERSION
[ -x "$VENV/bin/python" ] || python -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -c "import transformers, sys; sys.exit(transformers.__version__ != '$VERSION')" 2>/dev/null \
  || "$VENV/bin/pip" install -q --disable-pip-version-check "transformers==$VERSION"
echo "transformers $("$VENV/bin/python" -c 'import transformers; print(transformers.__version__)') in $VENV" >&2
[ $# -gt 0 ] || set -- tests/export
exec "$VENV/bin/python" -m pytest -n auto --dist loadgroup -q -p no:cacheprovider "$@"
