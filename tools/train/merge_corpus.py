"""Merge ``specdec distill`` folders into one corpus for tools/gpu/drafter.py --data (specdec/commands/distill/merge.py).

    python tools/train/merge_corpus.py FIRST OTHER [OTHER ...] --out MERGED

FIRST keeps its job numbers (a --features-cache made for it stays valid for MERGED); the others'
answered requests are appended. Prints a JSON record.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", type=Path, nargs="+", help="specdec distill folders; the first keeps its job numbers")
    ap.add_argument("--out", type=Path, required=True, help="a new folder")
    args = ap.parse_args()
    from specdec.commands.distill.merge import merge
    from specdec.errors import ConfigError

    try:
        record = merge(args.sources, args.out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
