"""What T5's relative position bias costs a decoder call, measured on a bundle's target.

T5's decoder self-attention adds a learned bias per (head, distance bucket) to the scores.
specdec's graph computes it for the call's positions against every buffer row and hands it to
GroupQueryAttention as ``attention_bias`` (export/seq2seq.py). This tool times the target's
decoder graph as exported against the same graph with that input removed (GroupQueryAttention
then adds nothing, and ONNX Runtime drops the bias computation as dead code), at S = 1 (a
plain step) and S = K (a verify call), interleaved, after a real source was encoded. The
outputs of the second graph are wrong by design: only its time means something.

    python tools/bench_t5_bias.py bundles/seq2seq-demo [--context 64] [--source 96] [--calls 300]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np


def without_bias(bundle: Path, file: str, out: Path) -> Path:
    """A copy of ``file`` whose GroupQueryAttention nodes take no attention_bias (weights hard-linked,
    not copied: ONNX Runtime refuses symlinks that leave the model's folder)."""
    import onnx

    model = onnx.load(str(bundle / file), load_external_data=False)
    cut = 0
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention" and len(node.input) > 10 and node.input[10]:
            del node.input[7:]
            cut += 1
    if not cut:
        raise SystemExit(f"{file}: no GroupQueryAttention takes an attention_bias; is this a T5 bundle?")
    for data in {t.external_data[0].value for t in model.graph.initializer if t.external_data}:
        os.link(bundle / data, out / data)
    path = out / file
    onnx.save(model, str(path))
    return path


def main() -> None:
    import onnxruntime as ort

    from specdec.engines.executor import Executor
    from specdec.engines.ort import open_session
    from specdec.engines.threads import ThreadPolicy
    from specdec.manifest import load_manifest

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--context", type=int, default=64, help="decoder rows already committed")
    ap.add_argument("--source", type=int, default=96, help="source tokens encoded")
    ap.add_argument("--calls", type=int, default=300, help="timed calls per graph and size")
    args = ap.parse_args()
    m = load_manifest(args.bundle)
    name, g = m.graph("target", "dynamic")
    enc_name, enc = m.graph("target", "encoder")
    policy = ThreadPolicy.of(None)
    rng = np.random.default_rng(0)
    source = rng.integers(3, m.vocab_size, size=min(args.source, m.max_source_len))
    prefix = rng.integers(3, m.vocab_size, size=args.context)
    times: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.bundle.resolve().parent) as tmp:  # the same file system: hard links
        cut = without_bias(args.bundle, g.file, Path(tmp))
        runners = {}
        for label, session in (
            ("with bias", open_session(args.bundle, name, g, threads=policy)),
            ("without", ort.InferenceSession(str(cut), policy.session_options(), providers=["CPUExecutionProvider"])),
        ):
            r = Executor(args.bundle, m, "target", {name: session, enc_name: open_session(args.bundle, enc_name, enc, threads=policy)})
            r.encode(0, source)
            r.forward([0], [prefix])
            r.commit(0, len(prefix))
            runners[label] = r
        for _ in range(args.calls):
            for s in (1, m.k):
                for label, r in runners.items():
                    t0 = time.perf_counter()
                    r.forward([0], [prefix[:s]])  # the fixed-length binding when s = K
                    times.setdefault((label, s), []).append(time.perf_counter() - t0)
    print(f"bundle {args.bundle}: target {m.target.parameters / 1e6:.1f}M params, {m.target.num_layers} decoder layers; "
          f"source {len(source)} tokens, {args.context} decoder rows committed, max-seq-len {m.max_seq_len}; "
          f"median of {args.calls} interleaved calls")  # fmt: skip
    print("| tokens per call | with the relative bias | without (wrong output) | bias cost |")
    print("|---|---|---|---|")
    for s in (1, m.k):
        a, b = (np.median(times[(label, s)]) * 1e3 for label in ("with bias", "without"))
        print(f"| {s} | {a:.3f} ms | {b:.3f} ms | {100 * (a / b - 1):+.1f}% |")


if __name__ == "__main__":
    main()
