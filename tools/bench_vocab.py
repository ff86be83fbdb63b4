#!/usr/bin/env python3
"""Where a decoding step's time goes at Gemma 3's 262,144-token vocabulary.

Exports a random-initialized model of Gemma-3-270M's shape (hidden 640, 18 layers of which
every 6th global, 4 heads, 1 KV head, head_dim 256, window 512, tied 262,144 x 640 embedding;
seeded, so the figures are about cost, not text) with a 1-layer draft of the same vocabulary,
then measures on this machine:

- the target's own decoding (γ = 0, greedy): ms per token;
- the LM head alone: the same MatMul [1, 640] x [640, 262144] in ONNX Runtime, ms per call;
- the NumPy work per token that the vocabulary scales: argmax of one row and of a verify call's
  γ + 1 rows (greedy), a sampled draw (temperature only), and standardizing a verify call's
  rows for speculative sampling (``runtime.sampling.standardize``).

    python tools/bench_vocab.py --work /tmp/vocab [--out docs/bench/families]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GEMMA3_270M = dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=256, query_pre_attn_scalar=256, sliding_window=512, vocab_size=262144, rope_theta=1e6,
                   rope_local_base_freq=1e4, max_position_embeddings=32768, bos_token_id=0, eos_token_id=1, pad_token_id=2)  # fmt: skip
GAMMA = 4


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def full_sort_top_p(scores: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p's mask by a full stable sort of every row: what ``runtime.sampling`` did before it
    sorted only the nucleus' candidates, kept here as the figure to compare with."""
    from specdec.runtime.sampling import softmax

    v = scores.shape[-1]
    order = v - 1 - np.argsort(scores[..., ::-1], axis=-1, kind="stable")
    cum = np.cumsum(softmax(np.take_along_axis(scores, order, axis=-1)), axis=-1)
    drop_sorted = cum <= 1.0 - top_p
    drop_sorted[..., -1] = False
    drop = np.empty_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, axis=-1)
    return drop


def fill_vocabulary(path: Path, size: int) -> None:
    """Give the small BPE tokenizer ``size`` entries (``<unused_i>`` after its own), so that a
    converter sizing the model by its tokenizer (llama.cpp's drops embedding rows past it) keeps
    the whole 262,144-row head."""
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]  # its special tokens are among these ids too
    vocab.update({f"<unused_{i}>": i for i in range(len(vocab), size)})
    path.write_text(json.dumps(tok))


def make_models(work: Path) -> tuple[Path, Path]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from models import make_tokenizer  # a small BPE tokenizer: the ids it makes are all the bench needs

    out = []
    for name, kw in (("target", GEMMA3_270M), ("draft", dict(GEMMA3_270M, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                                              head_dim=64, query_pre_attn_scalar=64))):  # fmt: skip
        folder = work / name
        if not (folder / "config.json").exists():
            torch.manual_seed(0)
            cfg = AutoConfig.for_model("gemma3_text", **kw)
            cfg.layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(cfg.num_hidden_layers)]
            AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
            make_tokenizer(folder)
            fill_vocabulary(folder / "tokenizer.json", cfg.vocab_size)
        out.append(folder)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    target, draft = make_models(args.work)
    bundle = args.work / "bundle"
    previous = args.out / "vocab.json" if args.out else None
    export_s = json.loads(previous.read_text()).get("export_seconds") if previous and previous.exists() else None
    if not (bundle / "manifest.json").exists():
        from specdec.export.pipeline import ExportConfig, export_bundle

        t0 = time.perf_counter()
        export_bundle(ExportConfig(str(target), str(draft), bundle, gamma=GAMMA, max_seq_len=1024))
        export_s = time.perf_counter() - t0

    import onnxruntime as ort
    from onnx import TensorProto, helper
    from safetensors.numpy import load_file

    from specdec.runtime import SamplingConfig, SpeculativeDecoder
    from specdec.runtime.sampling import draw, standardize

    dec = SpeculativeDecoder.load(bundle)
    prompt = list(range(3, 35))
    runs = [dec.generate(prompt, max_new_tokens=args.tokens, gamma=0, ignore_eos=True).stats for _ in range(3)]
    per_token = 1000 * statistics.median((s.total_seconds - s.prefill_seconds) / s.new_tokens for s in runs)

    weights = load_file(str(target / "model.safetensors"))
    emb = next(v for k, v in weights.items() if k.endswith("embed_tokens.weight"))  # [V, H]
    wt = np.ascontiguousarray(emb.T)  # [H, V]: the exported head's layout
    graph = helper.make_graph([helper.make_node("MatMul", ["h", "w"], ["logits"])], "head",
                              [helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, wt.shape[0]])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, wt.shape[1]])],
                              [helper.make_tensor("w", TensorProto.FLOAT, wt.shape, wt.tobytes(), raw=True)])  # fmt: skip
    from specdec.engines.threads import ThreadPolicy

    opts = ThreadPolicy.of(None).session_options()  # the bundle's graphs' own thread settings
    sess = ort.InferenceSession(helper.make_model(graph).SerializeToString(), opts, providers=["CPUExecutionProvider"])
    h = np.random.default_rng(0).standard_normal((1, wt.shape[0])).astype(np.float32)
    head = median_ms(lambda: sess.run(None, {"h": h}), 20)

    rng = np.random.default_rng(0)
    vocab = wt.shape[1]
    row = rng.standard_normal(vocab).astype(np.float32) * 4
    rows = rng.standard_normal((GAMMA + 1, vocab)).astype(np.float32) * 4  # flat: random logits; the nucleus at 0.9 holds ~300-2300 tokens
    peaked = rows.copy()  # an LM's usual row: a few dozen plausible tokens far above the rest
    peaked[:, rng.choice(vocab, 32, replace=False)] += 16
    q = np.empty(vocab, dtype=np.float32)
    t1 = SamplingConfig(1.0)
    numpy_ms = {
        "argmax of 1 row": median_ms(lambda: row.argmax(), 50),
        f"argmax of {GAMMA + 1} rows (greedy verify)": median_ms(lambda: rows.argmax(-1), 50),
        "draw one token, T=1 (softmax in place + inverse CDF)": median_ms(lambda: draw(row, t1, rng, q), 20),
        f"standardize {GAMMA + 1} rows, T=1 (speculative sampling)": median_ms(lambda: standardize(rows, t1), 10),
        f"standardize {GAMMA + 1} peaked rows, T=1, top-p 0.9": median_ms(lambda: standardize(peaked, SamplingConfig(1.0, None, 0.9)), 10),
        f"standardize {GAMMA + 1} flat rows, T=1, top-p 0.9 (worst case)": median_ms(lambda: standardize(rows, SamplingConfig(1.0, None, 0.9)), 5),
        f"top-p 0.9 mask of {GAMMA + 1} flat rows by a full sort (the previous way)": median_ms(lambda: full_sort_top_p(rows, 0.9), 5),
        f"standardize {GAMMA + 1} rows, T=1, top-k 64": median_ms(lambda: standardize(rows, SamplingConfig(1.0, 64, None)), 10),
    }
    result = {"model": "Gemma-3-270M shape, random weights", "vocab": vocab, "export_seconds": export_s,
              "target_ms_per_token": per_token, "head_ms_per_call": head, "head_share": head / per_token,
              "numpy": [{"work": k, "ms": v, "share_of_token": v / per_token} for k, v in numpy_ms.items()]}  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "vocab.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
