"""Why a float16 bundle decodes wrong on CUDA in some decoders and right in others.

The H100 run of 2026-11-27 (docs/bench/gpu) found float16 SmolLM2 greedy output on CUDA equal
to the CPU's in every second decoder made (forks 2, 4, 6), and wrong from the first token in
the others, while float32 bundles were right everywhere. Each experiment below decodes the same
prompts greedily on CUDA and compares with the CPU provider; one JSON line per experiment.

    python tools/gpu/diag_kv.py BUNDLE OUT
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

PROMPTS = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', "The three most important things to know about photosynthesis are",
           "import numpy as np\n\n\ndef normalize(x):\n"]  # fmt: skip
TOKENS = 24


def main(bundle: Path, out: Path) -> None:
    import os

    try:
        import torch  # noqa: F401 - loads the CUDA pip libraries (cuBLAS 13, ...) the CUDA provider links, as check.py does
    except ImportError:
        pass
    import onnxruntime as ort

    from specdec.engines import binding

    dev_provider = os.environ.get("DIAG_PROVIDER", "cuda")  # "cpu": the dry run here
    from specdec.runtime import SpeculativeDecoder

    out.mkdir(parents=True, exist_ok=True)
    log = (out / "diag.jsonl").open("a")
    t0 = time.monotonic()

    def record(name: str, **fields) -> None:
        line = json.dumps({"experiment": name, "t": round(time.monotonic() - t0, 1), **fields})
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    record("env", ort=ort.__version__, providers=ort.get_available_providers())
    cpu = SpeculativeDecoder.load(bundle, provider="cpu", drafter="lookup")
    want = [cpu.generate(p, max_new_tokens=TOKENS, ignore_eos=True, gamma=0).tokens for p in PROMPTS]

    def check(dec, fill=None) -> list:
        """First differing index per prompt (None: equal)."""
        got = []
        for p in PROMPTS:
            if fill is not None:
                for ex in dec.engine.models:
                    for view in ex.cache.views:
                        for buf in (*view.keys, *view.values):
                            if hasattr(buf, "update_inplace"):
                                buf.update_inplace(fill(view))
                            else:
                                buf[...] = fill(view)
            got.append(dec.generate(p, max_new_tokens=TOKENS, ignore_eos=True, gamma=0).tokens)
        return [None if g == w else next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w))) for g, w in zip(got, want)]

    def safe(name, fn, **fields):
        try:
            record(name, diff=fn(), **fields)
        except Exception as e:  # noqa: BLE001 - a diagnostic records what broke and goes on
            record(name, error=f"{type(e).__name__}: {e}", **fields)

    # 1. The fork sequence of the check: is it the decoder's allocation that decides?
    dev = SpeculativeDecoder.load(bundle, provider=dev_provider, drafter="lookup")
    safe("first decoder", lambda: check(dev))
    dec = None
    for i in range(4):
        dec = dev.fork("lookup")
        safe(f"fork {i + 1} (previous alive while made)", lambda: check(dec))
    spec = SpeculativeDecoder.load(bundle, provider=dev_provider, drafter="lookup")
    safe("lookup drafter, gamma 4 (verify graph)", lambda: [None if spec.generate(p, max_new_tokens=TOKENS, ignore_eos=True, gamma=4).tokens == w else "differs" for p, w in zip(PROMPTS, want)])
    # 2. What the cache holds before a prompt: zeros, NaN, large finite values.
    shape_fill = {"zeros": lambda v: np.zeros(v.shape, v.dtype), "nan": lambda v: np.full(v.shape, np.nan, v.dtype),
                  "1e3": lambda v: np.full(v.shape, 1e3, v.dtype), "randn": lambda v: np.random.default_rng(0).standard_normal(v.shape).astype(v.dtype)}  # fmt: skip
    for name, fill in shape_fill.items():
        safe(f"cache filled with {name} before each prompt", lambda: check(dev, fill))
    # 3. Every input bound again before each run (device KV too), and synchronised outputs.
    orig_stale, orig_run = binding.stale_memories, binding.Binding.run
    binding.stale_memories = lambda device, dtype: frozenset({"cpu", "cuda"})
    safe("device KV bound again each run", lambda: check(SpeculativeDecoder.load(bundle, provider=dev_provider, drafter="lookup")))
    binding.stale_memories = orig_stale

    def synced(self):
        for name, args in self.inputs.items():
            self.io.bind_input(name, *args)
        self.io.synchronize_inputs()
        self.session.run_with_iobinding(self.io)
        self.io.synchronize_outputs()

    binding.Binding.run = synced
    safe("synchronize inputs and outputs", lambda: check(SpeculativeDecoder.load(bundle, provider=dev_provider, drafter="lookup")))
    binding.Binding.run = orig_run
    # 4. No binding at all: plain session.run of the target's prompt, past KV from NumPy.
    safe("plain run, no binding", lambda: plain(bundle))
    record("done")


def plain(bundle: Path) -> dict:
    """The prompt's last logits' argmax from session.run on CPU and CUDA, past KV zeros or NaN
    (shared-buffer shapes, so GQA reads seqlens_k for what is valid)."""
    import onnxruntime as ort

    from specdec.manifest import load_manifest
    from specdec.runtime.text import TextCodec

    m = load_manifest(bundle, "size")
    name, g = m.graph("target", "dynamic")
    ids = np.array([TextCodec.from_bundle(bundle, m).encode(PROMPTS[1])], dtype=np.int64)  # [1, S]
    S = ids.shape[1]
    t = m.target
    res = {}
    for prov in ("CPUExecutionProvider", "CUDAExecutionProvider"):
        s = ort.InferenceSession(str(bundle / g.file), providers=[prov, "CPUExecutionProvider"] if prov != "CPUExecutionProvider" else [prov])
        for fill in ("zeros", "nan"):
            feed = {g.io.ids: ids, g.io.positions: np.arange(S, dtype=np.int64)[None], g.io.seqlens: np.array([S - 1], np.int32), g.io.total: np.array(S, np.int32)}
            kv = np.zeros((1, t.num_kv_heads, m.max_seq_len, t.head_dim), np.float16 if m.dtype == "float16" else np.float32)
            if fill == "nan":
                kv[:] = np.nan
            for k_name, v_name in g.io.past:
                feed[k_name], feed[v_name] = kv, kv
            logits = s.run([g.io.logits], feed)[0]
            res[f"{prov[:4]}/{fill}"] = {"argmax": int(np.argmax(logits[0, -1])), "nan": bool(np.isnan(logits).any())}
    return res


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path, help="a float16 bundle (tools/gpu/diag.sh sends the demo pair's)")
    ap.add_argument("out", type=Path, help="where diag.jsonl goes")
    a = ap.parse_args()
    main(a.bundle, a.out)
