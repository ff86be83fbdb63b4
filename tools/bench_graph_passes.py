"""One graph pass's worth, measured alone: a bundle against a copy of it with export/optimize.py's
later passes applied to its graphs, without exporting again (a real model's export takes minutes
to tens of minutes here).

    python tools/bench_graph_passes.py BUNDLE [BUNDLE ...] --out docs/bench/graph-passes/results.json

Per bundle: the copy (weights hard-linked, graphs rewritten, integrity recorded again) in
``--work``; greedy decoding at γ = 0 of the held-out chat prompts through both, interleaved over
``--rounds``, token for token compared; tokens/s (the median over rounds); and the target's
op split (specdec/bench/opsplit.py) for a 1-token call, before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx

from specdec.bench.report import write_results
from specdec.export.optimize import drop_attention_reshapes, pack_qkv_into_attention

PASSES = {"packed_qkv_attention": pack_qkv_into_attention, "attention_reshapes": drop_attention_reshapes}


def _inline_small(proto: onnx.ModelProto, base: Path, most: int = 1 << 16) -> None:
    """Small external initializers (biases a pass concatenates, shapes it reads) read into the graph;
    the weight matrices stay in the bundle's files. Read by offset here: onnx's own reader refuses a
    file with several hard links, which the copies below make."""
    for t in proto.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL or int(np.prod(t.dims)) > most:
            continue
        info = {e.key: e.value for e in t.external_data}
        with open(base / info["location"], "rb") as f:
            f.seek(int(info.get("offset", 0)))
            t.raw_data = f.read(int(info["length"]))
        t.data_location = onnx.TensorProto.DEFAULT
        del t.external_data[:]


def rewritten(bundle: Path, work: Path, passes: dict = PASSES, suffix: str = "-passes") -> tuple[Path, dict[str, dict[str, int]]]:
    """A copy of ``bundle`` under ``work`` with ``passes`` applied to every graph; per graph, what each pass did."""
    from specdec import integrity
    from specdec.manifest import MANIFEST_NAME

    out = work / (bundle.name + suffix)
    shutil.rmtree(out, ignore_errors=True)
    counts = {}
    for src in bundle.rglob("*"):
        dst = out / src.relative_to(bundle)
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.suffix == ".onnx":
            proto = onnx.load(str(src), load_external_data=False)
            _inline_small(proto, src.parent)
            counts[src.name] = {name: fn(proto) for name, fn in passes.items()}
            onnx.save(proto, str(dst))
        elif src.name != MANIFEST_NAME:
            os.link(src, dst)
    manifest = json.loads((bundle / MANIFEST_NAME).read_text())
    manifest["integrity"] = integrity.record(out, skip=(MANIFEST_NAME,))
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
    return out, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="+", type=Path)
    ap.add_argument("--work", type=Path, default=Path(".bench/passes"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from specdec.bench.corpus import chat_prompts
    from specdec.bench.opsplit import profile_calls
    from specdec.bench.sweep import interleaved
    from specdec.manifest import load_manifest
    from specdec.runtime import SpeculativeDecoder

    rows = []
    for bundle in args.bundles:
        after, counts = rewritten(bundle, args.work)
        decoders = {"before": SpeculativeDecoder.load(bundle, drafter="lookup"), "after": SpeculativeDecoder.load(after, drafter="lookup")}
        m = decoders["before"].manifest
        prompts = chat_prompts(bundle, m, decoders["before"].codec, "chat", args.prompts)
        tok_s = {k: [] for k in decoders}
        tokens = {}
        for _, name in interleaved(list(decoders), args.rounds):
            dec, new, seconds = decoders[name], 0, 0.0
            outs = []
            for p in prompts:
                res = dec.generate(p, max_new_tokens=args.tokens, ignore_eos=True, gamma=0)
                outs.append(res.tokens)
                new += len(res.tokens)
                seconds += res.stats.total_seconds - res.stats.prefill_seconds
            tok_s[name].append(new / seconds)
            tokens[name] = outs
        splits = {name: profile_calls(path, load_manifest(path, "size"), calls=32).as_dict() for name, path in (("before", bundle), ("after", after))}
        row = {
            "bundle": str(bundle), "dtype": m.dtype, "width": getattr(m, "quantization", None) or "fp32",
            "passes": counts[Path(m.graph("target", "dynamic")[1].file).name],
            "tok_s_before": round(float(np.median(tok_s["before"])), 2), "tok_s_after": round(float(np.median(tok_s["after"])), 2),
            "ratio": round(float(np.median(tok_s["after"]) / np.median(tok_s["before"])), 3),
            "same_tokens": sum(a == b for a, b in zip(tokens["before"], tokens["after"])), "prompts": len(prompts),
            "other_ms_before": splits["before"]["groups_ms"]["other"], "other_ms_after": splits["after"]["groups_ms"]["other"],
            "call_ms_before": splits["before"]["call_ms"], "call_ms_after": splits["after"]["call_ms"],
            "op_split": splits,
        }  # fmt: skip
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "op_split"}), flush=True)
    what = (f"greedy decoding at γ = 0, {args.prompts} held-out chat prompts x {args.tokens} tokens, {args.rounds} interleaved rounds (median); "
            "op split: the target's 1-token call under ORT's profiler (its times include the profiler's own cost)")  # fmt: skip
    if args.out:
        write_results(args.out.parent, None, {"what": what, "rows": rows}, name=args.out.stem)


if __name__ == "__main__":
    main()
