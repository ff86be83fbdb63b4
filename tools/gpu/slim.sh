#!/usr/bin/env bash
# Send a slim tree to the device machine, then put the checkout back.
#
#   tools/gpu/slim.sh on    # a local branch gpu-slim without models/ (~6 MiB of tracked files
#                           # instead of ~120): the device tool sends the tracked files, and a
#                           # call takes 64 MiB in all; the payload (tools/gpu/pack.py) carries
#                           # the models the check needs
#   tools/gpu/slim.sh off   # back to the branch you were on; gpu-slim is deleted
#
# Users and CI never see gpu-slim: it is never pushed. Commit before "on".
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mark=.git/gpu-slim-from
case ${1:-} in
  on)
    git diff --quiet && git diff --cached --quiet || { echo "slim.sh: commit or stash your changes first" >&2; exit 2; }
    git rev-parse --abbrev-ref HEAD > "$mark"
    git checkout -q -B gpu-slim
    git rm -r -q --cached models
    git commit -q -m "gpu-slim: the tree without models/ (local only, never pushed)"
    rm -rf models
    echo "tracked: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes"
    ;;
  off)
    [ -f "$mark" ] || { echo "slim.sh: not on a slim tree (no $mark)" >&2; exit 2; }
    git checkout -q "$(cat "$mark")"
    git branch -q -D gpu-slim
    rm "$mark"
    git status --short | head
    ;;
  *) echo "usage: tools/gpu/slim.sh on|off" >&2; exit 2 ;;
esac
