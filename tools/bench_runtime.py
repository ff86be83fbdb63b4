"""End-to-end decoding speed of the runtime: speculative (γ = 1..4) against γ = 0 on one engine.

No trained pair is reachable here (no hub), so the pair is built to have a known kind of
agreement: a 12-layer Llama target (random weights, peaked) whose layers 2..12 write only a
small residual (x ``--residual``), and a draft that is the target's first layer with its
embedding, final norm and head — a layer-skip draft, ~1/4 of the target's cost per token.
The numbers to read are the *relation* between measured speedup and the paper's prediction
(Theorem 3.8 with measured α, c and verify cost v), which shows what the loop itself costs.

    python tools/bench_runtime.py [--tokens 200] [--rounds 3] [--residual 0.05] [--threads 2]

Every γ runs the same prompts in interleaved rounds (so machine noise hits all alike; the
measurement is ``specdec.bench``, as in ``specdec bench``); greedy and sampled (T = 1)
decoding are both measured. Writes .bench/runtime/results.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".bench" / "runtime"
TARGET = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=12, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=8000, max_position_embeddings=1024, tie_word_embeddings=True)
PROMPTS = [[11, 802, 3391, 17, 5, 99, 1024], [7000, 12, 12, 640], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]


def build_pair(folder: Path, residual: float) -> tuple[Path, Path]:
    """Target and layer-skip draft checkpoints (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    target_dir, draft_dir = folder / "target", folder / "draft"
    if (draft_dir / "config.json").is_file():
        return target_dir, draft_dir
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**TARGET, bos_token_id=1, eos_token_id=2)).eval()
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() == 2:
                p.mul_(2.0)  # peaked next-token distributions, with logits small enough for the 1e-4 check
        target.model.norm.weight.mul_(4.0)
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(residual)
            layer.mlp.down_proj.weight.mul_(residual)
    target.save_pretrained(target_dir, safe_serialization=True)
    draft = LlamaForCausalLM(LlamaConfig(**{**TARGET, "num_hidden_layers": 1}, bos_token_id=1, eos_token_id=2)).eval()
    missing = draft.load_state_dict(target.state_dict(), strict=False)
    assert not missing.missing_keys, missing.missing_keys
    draft.save_pretrained(draft_dir, safe_serialization=True)
    return target_dir, draft_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--residual", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gammas", default="0,1,2,3,4")
    args = ap.parse_args()

    import onnxruntime

    from specdec.export.pipeline import ExportConfig, export_bundle
    from specdec import bench
    from specdec.runtime import SpeculativeDecoder

    WORK.mkdir(parents=True, exist_ok=True)
    target, draft = build_pair(WORK / f"pair-r{args.residual}", args.residual)
    bundle = WORK / f"bundle-r{args.residual}"
    if not (bundle / "manifest.json").is_file():
        t0 = time.perf_counter()
        export_bundle(ExportConfig(str(target), str(draft), bundle, gamma=4, max_seq_len=512))
        print(f"exported in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    dec = SpeculativeDecoder.load(bundle, threads=args.threads)
    gammas = sorted({0, *(int(g) for g in args.gammas.split(","))})
    cfgs = bench.configs(["model"], gammas, adaptive=False)
    results = {
        mode: bench.summarize(bench.run({"model": dec}, cfgs, PROMPTS, args.tokens, args.rounds, t))
        for mode, t in (("greedy", 0.0), ("sampled, T=1", 1.0))
    }
    m = dec.manifest
    header = (
        f"Target: Llama {m.target.parameters / 1e6:.1f}M params ({m.target.num_layers} layers, vocab {m.vocab_size}), "
        f"draft: its first layer + head ({m.draft.parameters / 1e6:.1f}M), float32, ONNX Runtime {onnxruntime.__version__}, "
        f"CPU, {args.threads} threads; {len(PROMPTS)} prompts x {args.rounds} rounds x {args.tokens} new tokens per γ, interleaved."
    )
    md = header + "\n\n" + "\n".join(bench.markdown(mode, rows) for mode, rows in results.items())
    (WORK / "results.json").write_text(json.dumps(dict(args=vars(args), results={k: bench.as_dict(v) for k, v in results.items()}), indent=2))
    (WORK / "results.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
