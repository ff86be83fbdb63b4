"""What one token's grammar step costs at a vocabulary's size: llguidance's mask and matcher step.

    python tools/bench_grammar_mask.py BUNDLE [BUNDLE ...] [--repeats 20] [--out docs/bench/structured/mask]

For each bundle's tokenizer (SmolLM2's 49,152 tokens, Gemma-3's 262,144), each of three JSON
schemas of tools/bench_structured.py is walked along one valid answer, token by token, as
``GrammarState`` does it while decoding: the matcher follows the prefix (``sync``), then the
mask of allowed tokens is computed and expanded to a [V] bool row (``allowed``). Reported: the
median and 90th percentile per token over the walk, repeated; and the compile time of each
schema (once per schema: the cache keeps it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specdec.bench.report import footer, write_results

ANSWERS = [  # (index into bench_structured.TASKS, a valid answer as a model would write it)
    (0, {"name": "Maria Lopez", "age": 34, "job": "nurse", "city": "Madrid"}),
    (2, {"name": "Mars", "moons": 2, "has_rings": False, "distance_million_km": 227.9}),
    (6, {"countries": [{"country": "France", "capital": "Paris"}, {"country": "Spain", "capital": "Madrid"},
                       {"country": "Italy", "capital": "Rome"}]}),
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundles", type=Path, nargs="+")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import numpy as np
    from bench_structured import TASKS

    from specdec.manifest import load_manifest
    from specdec.runtime.constraints import JSON_OPTIONS, Grammars, StructuredOutputs
    from specdec.runtime.text import TextCodec

    rows = []
    for bundle in args.bundles:
        m = load_manifest(bundle, verify="size")
        codec = TextCodec.from_bundle(bundle, m)
        t0 = time.perf_counter()
        grammars = Grammars(codec.tokenizer.to_str(), m.vocab_size, m.eos_token_ids)
        setup = time.perf_counter() - t0
        for task, answer in ANSWERS:
            spec = StructuredOutputs(json=TASKS[task][1])
            t0 = time.perf_counter()
            grammars.matcher(spec)
            compile_s = time.perf_counter() - t0
            text = json.dumps(answer, separators=(JSON_OPTIONS["item_separator"], JSON_OPTIONS["key_separator"]))
            ids = np.asarray(codec.encode(text, special=False), dtype=np.int64)
            per = []
            for _ in range(args.repeats):
                state = grammars.state(spec, 0)
                for t in range(len(ids) + 1):
                    a = time.perf_counter()
                    assert state.sync(ids[:t]), (bundle, task, t)
                    ok = state.allowed()
                    per.append(time.perf_counter() - a)
                    assert t == len(ids) or ok[ids[t]], (bundle, task, t)
                assert state.accepting(ids)
            per.sort()
            rows.append({"bundle": str(bundle), "vocab": m.vocab_size, "task": task, "answer_tokens": len(ids), "tokenizer_setup_s": setup,
                         "compile_ms": 1000 * compile_s, "median_us": 1e6 * statistics.median(per), "p90_us": 1e6 * per[int(0.9 * len(per))]})  # fmt: skip
    lines = ["| bundle | vocabulary | schema (bench_structured TASKS) | answer tokens | compile | per token, median | per token, p90 | tokenizer setup |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {Path(r['bundle']).name} | {r['vocab']:,} | {r['task']} | {r['answer_tokens']} | {r['compile_ms']:.1f} ms | "
                     f"{r['median_us']:.0f} µs | {r['p90_us']:.0f} µs | {r['tokenizer_setup_s']:.2f} s |")  # fmt: skip
    md = "\n".join(lines) + "\n"
    prov = write_results(args.out, md, {"rows": rows})
    print(md + (footer(prov) if prov else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
