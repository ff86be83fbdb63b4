"""Per-call latency of specdec's exported graphs next to onnxruntime-genai's model builder graph.

One ~30M-parameter Llama checkpoint (random weights: latency does not depend on them) is
exported by specdec (a static verify graph for each K = 1..8, and the draft step graph of a
small draft) and by the onnxruntime-genai model builder (in its own venv, transformers 5).
Both run on this process's ONNX Runtime with the same session options and preallocated,
bound buffers, with the KV cache as a shared in-place buffer on both sides. For each
(past, K) the two sides are timed in alternating blocks, so machine noise hits both alike.

    python tools/bench_export.py [--k 1,2,4,8] [--past 256,1024] [--rounds 5] [--calls 20]

Writes .bench/export/results.json and results.md (a Markdown table) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import genai_baseline  # sibling tool: tools/ is this script's folder, first on sys.path

ROOT = Path(__file__).resolve().parents[1]

TARGET = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=True)
DRAFT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=True)
MAX_SEQ = 2048


def checkpoint(folder: Path, spec: dict) -> int:
    """A random-weight Llama checkpoint with a small tokenizer file (the builder insists on one)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**spec, bos_token_id=1, eos_token_id=2))
    if not (folder / "config.json").is_file():
        model.save_pretrained(folder, safe_serialization=True)
        vocab = {f"t{i}": i for i in range(100)}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2").save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def ours(hf_dir: Path, work: Path, ks: list[int]) -> dict[int, Path]:
    """specdec's optimized decoder graph for each K (the verify graph; K = 1 is the step graph's shape)."""
    from transformers import AutoModelForCausalLM

    from specdec.export.graphs import export_decoder
    from specdec.export.optimize import optimize_for_cpu

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    cfg = model.config
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for k in ks:
        path = work / f"k{k}.onnx"
        if not path.is_file():
            export_decoder(model, path, k, MAX_SEQ, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, "float32")
            optimize_for_cpu(path, MAX_SEQ)  # as specdec-export ships it
        out[k] = path
    return out


def our_runner(path: Path, k: int, past: int, threads: int):
    """A zero-argument call of our graph with ``past`` committed rows, as the runtime binds it."""
    import onnx

    from specdec.engines.kv import KVCache
    from specdec.engines.ort import runner_for
    from specdec.export.graphs import signature
    from specdec.manifest import GraphSpec

    g = onnx.load(str(path), load_external_data=False).graph
    layers = sum(1 for i in g.input if i.name.startswith("past_key_"))
    kv = [d.dim_value for d in next(i for i in g.input if i.name == "past_key_0").type.tensor_type.shape.dim]
    vocab = g.output[0].type.tensor_type.shape.dim[2].dim_value
    inputs, outputs, io = signature(layers, kv[1], kv[3], vocab, MAX_SEQ, k, "float32")
    spec = GraphSpec(file=path.name, sha256="", model="target", role="verify", tokens=k,
                     inputs=inputs, outputs=outputs, io=io)
    cache = KVCache(layers, kv[1], MAX_SEQ, kv[3], "float32")
    rng = np.random.default_rng(0)
    for buf in (*cache.keys, *cache.values):
        buf[...] = rng.standard_normal(buf.shape, dtype=np.float32) * 0.5
    cache.length = past
    dec = runner_for(path.parent, path.stem, spec, cache, threads=threads)
    ids = rng.integers(3, vocab, size=k)
    return lambda: dec.run(ids)


def their_runner(model: Path, k: int, past: int, threads: int):
    sess = genai_baseline.session(model, threads)
    facts = genai_baseline.graph_facts(model)
    io, alive = genai_baseline.bind_call(sess, facts, k, past, True, np.random.default_rng(0))
    return lambda: (sess.run_with_iobinding(io), alive)


def interleaved(a, b, rounds: int, calls: int) -> tuple[list[float], list[float]]:
    """Per-call ms of a and b, timed in alternating blocks of ``calls`` after a warm-up."""
    for f in (a, b):
        for _ in range(5):
            f()
    ta, tb = [], []
    for _ in range(rounds):
        for f, acc in ((a, ta), (b, tb)):
            for _ in range(calls):
                t0 = time.perf_counter()
                f()
                acc.append((time.perf_counter() - t0) * 1e3)
    return ta, tb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--past", default="256,1024")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=ROOT / ".bench" / "export")
    args = ap.parse_args()
    ks = [int(x) for x in args.k.split(",")]
    pasts = [int(x) for x in args.past.split(",")]
    work = args.work
    work.mkdir(parents=True, exist_ok=True)

    params = checkpoint(work / "target-hf", TARGET)
    draft_params = checkpoint(work / "draft-hf", DRAFT)
    print(f"target: Llama {params / 1e6:.1f}M params; draft: {draft_params / 1e6:.1f}M params", file=sys.stderr)
    mine = ours(work / "target-hf", work / "ours", ks)
    draft_step = ours(work / "draft-hf", work / "ours-draft", [1])[1]
    theirs = genai_baseline.build(work / "target-hf", work / "genai")

    rows = []
    for past in pasts:
        for k in ks:
            ta, tb = interleaved(our_runner(mine[k], k, past, args.threads), their_runner(theirs, k, past, args.threads),
                                 args.rounds, args.calls)
            rows.append(dict(past=past, k=k, ours_ms=float(np.median(ta)), genai_ms=float(np.median(tb)),
                             ours_p90=float(np.percentile(ta, 90)), genai_p90=float(np.percentile(tb, 90))))
            print(f"past {past} K {k}: ours {rows[-1]['ours_ms']:.2f} ms, genai {rows[-1]['genai_ms']:.2f} ms", file=sys.stderr)
        step = our_runner(draft_step, 1, past, args.threads)
        ts, _ = interleaved(step, step, args.rounds, args.calls)
        rows.append(dict(past=past, k="draft step", ours_ms=float(np.median(ts)), genai_ms=None))

    lines = [
        f"Target: Llama, {params / 1e6:.1f}M params (hidden 512, 6 layers, 8/4 heads, vocab 32000), float32, "
        f"ONNX Runtime {__import__('onnxruntime').__version__}, CPU, {args.threads} threads; "
        f"median of {args.rounds}x{args.calls} calls per side, interleaved. Draft step: {draft_params / 1e6:.1f}M-param Llama.",
        "",
        "| past | K | specdec verify (ms) | genai builder (ms) | specdec / genai |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = f"{r['ours_ms'] / r['genai_ms']:.2f}" if r["genai_ms"] else "–"
        genai = f"{r['genai_ms']:.2f}" if r["genai_ms"] else "–"
        lines.append(f"| {r['past']} | {r['k']} | {r['ours_ms']:.2f} | {genai} | {ratio} |")
    table = "\n".join(lines)
    (work / "results.json").write_text(json.dumps(rows, indent=2))
    (work / "results.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
