"""A quantized bundle's copy whose MatMulNBits round activations otherwise: one change at a time
for what moves a quantized model (docs/quantization.md).

    python tools/activation_variant.py INT8 --accuracy-level 0 --work .bench/variants
    python tools/bench_quality.py --reference FP32 --bundle int8=INT8 --bundle int8-fp32-act=.bench/variants/INT8-acc0 --no-speed ...

``accuracy_level`` 4 (what export writes) quantizes each row's activations to int8 per block of 32
before the product; 0 keeps them float32 (ONNX Runtime's slow path on CPU: for quality, not speed).
The weights stay the bundle's own (hard-linked); only the target's and draft's graph attributes change.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import onnx


def set_accuracy(level: int):
    def apply(proto: onnx.ModelProto) -> int:
        done = 0
        for n in proto.graph.node:
            if n.op_type == "MatMulNBits":
                for a in n.attribute:
                    if a.name == "accuracy_level":
                        a.i = level
                        done += 1
        return done

    return apply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--accuracy-level", type=int, required=True, choices=(0, 1, 2, 3, 4))
    ap.add_argument("--work", type=Path, default=Path(".bench/variants"))
    a = ap.parse_args()

    from bench_graph_passes import rewritten

    out, counts = rewritten(a.bundle, a.work, {"accuracy_level": set_accuracy(a.accuracy_level)}, f"-acc{a.accuracy_level}")
    print(f"{out}: accuracy_level {a.accuracy_level} on {sum(c['accuracy_level'] for c in counts.values())} MatMulNBits nodes")


if __name__ == "__main__":
    main()
