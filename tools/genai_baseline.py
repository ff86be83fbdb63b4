#!/usr/bin/env python3
"""Baseline: the onnxruntime-genai model builder's graph of a HF checkpoint, timed per call.

The builder (onnxruntime-genai 0.18) needs transformers 5, so it runs in a private venv
(``<root>/genai-venv``). The graph it writes is then timed here with the *system*
onnxruntime, so that it and our own exporter's graph run on the same ORT build.

    python tools/genai_baseline.py --hf-dir DIR --work DIR --k 1,2,4,8 --past 256,1024 [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# Verified together (2026-11, Python 3.11, CPU): the model builder needs transformers 5.
VENV_PACKAGES = ["onnxruntime-genai==0.18.0", "transformers==5.23.0", "torch==2.13.0", "onnx==1.23.2", "onnx_ir==1.1.0"]
WARMUP = 5
DEFAULT_ROOT = Path(__file__).resolve().parents[1] / ".bench"  # git-ignored


def _log(msg: str) -> None:
    print(f"[genai_baseline] {msg}", file=sys.stderr, flush=True)


GENAI_PROBE = "import onnxruntime_genai.models.builder"


def ensure_venv(root: Path, setup: bool = True) -> Path:
    """Create (once) ``root/genai-venv`` holding the model builder; return its python
    (``peers.venv.ensure_venv``: a stamp of the pins, pip's log beside the venv)."""
    from peers.venv import VenvSpec
    from peers.venv import ensure_venv as ensure

    spec = VenvSpec(name="genai-venv", packages=tuple(VENV_PACKAGES), probe=GENAI_PROBE, note="CPU torch; ~1 min", root=root)
    return ensure(spec, setup)


def build(hf_dir: Path, out_dir: Path, precision: str = "fp32", root: Path | None = None) -> Path:
    """Run the model builder on a local checkpoint folder (CPU EP); return ``model.onnx``.

    ``root`` is where the venv lives (default: ``<repo>/.bench``). Cached: an existing
    ``out_dir/model.onnx`` with its ``genai_config.json`` is reused as is.
    """
    model = out_dir / "model.onnx"
    if model.is_file() and (out_dir / "genai_config.json").is_file():
        _log(f"reusing built model {model}")
        return model
    if not any((hf_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise FileNotFoundError(f"{hf_dir} has no tokenizer file: the model builder needs one")
    python = ensure_venv(root or DEFAULT_ROOT)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [str(python), "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir.resolve()),
           "-o", str(out_dir.resolve()), "-p", precision, "-e", "cpu",
           "-c", str((out_dir.parent / "builder-cache").resolve())]
    _log("running " + " ".join(cmd))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not model.is_file():
        sys.stderr.write(proc.stdout[-4000:])
        raise RuntimeError(f"model builder failed (rc={proc.returncode})")
    _log(f"built {model} in {time.perf_counter() - t0:.1f}s")
    return model


def graph_facts(model_onnx: Path) -> dict[str, Any]:
    """Names, KV shape and features of a builder graph (from the graph and genai_config.json)."""
    import onnx

    cfg = json.loads((model_onnx.parent / "genai_config.json").read_text())
    dec = cfg["model"]["decoder"]
    graph = onnx.load(str(model_onnx), load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    n_layers = dec["num_hidden_layers"]
    ins, outs = dec["inputs"], dec["outputs"]
    return {
        "inputs": [i.name for i in graph.input],
        "outputs": [o.name for o in graph.output],
        "uses_gqa": "GroupQueryAttention" in ops,
        "attention_ops": sorted(ops & {"GroupQueryAttention", "MultiHeadAttention", "Attention"}),
        "past_present_share_buffer": bool(cfg["search"].get("past_present_share_buffer", False)),
        "max_length": int(cfg["search"].get("max_length", cfg["model"]["context_length"])),
        "kv_shape": (dec["num_key_value_heads"], dec["head_size"]),
        "vocab": int(cfg["model"]["vocab_size"]),
        "pkv": [(ins["past_key_names"] % i, ins["past_value_names"] % i) for i in range(n_layers)],
        "present": [(outs["present_key_names"] % i, outs["present_value_names"] % i) for i in range(n_layers)],
        "input_ids": ins["input_ids"], "attention_mask": ins.get("attention_mask"),
        "position_ids": ins.get("position_ids"), "logits": outs["logits"],
    }


def session(model_onnx: Path, threads: int) -> Any:
    """Their graph in a session with exactly the options specdec's engines use."""
    import onnxruntime as ort

    from specdec.engines.threads import ThreadPolicy

    options = ThreadPolicy.per_session(threads).session_options()
    return ort.InferenceSession(str(model_onnx), options, providers=["CPUExecutionProvider"])


def _int_dtype(sess: Any, name: str) -> type:
    """numpy dtype of an integer graph input (the builder uses int64; int32 is honoured too)."""
    kind = next(i.type for i in sess.get_inputs() if i.name == name)
    return np.int32 if kind == "tensor(int32)" else np.int64


def bind_call(sess: Any, facts: dict[str, Any], k: int, past: int, share: bool,
               rng: np.random.Generator) -> tuple[Any, dict[str, Any]]:
    """Preallocate every input/output of one (K, P) call; return (IOBinding, its OrtValues)."""
    import onnxruntime as ort

    names = {i.name for i in sess.get_inputs()}
    hkv, hd = facts["kv_shape"]
    kv_len = facts["max_length"] if share else past
    if share and past + k > kv_len:
        raise ValueError(f"past+k={past + k} exceeds the shared KV buffer ({kv_len})")
    arrays: dict[str, np.ndarray] = {
        facts["input_ids"]: rng.integers(3, facts["vocab"], (1, k)).astype(_int_dtype(sess, facts["input_ids"]))}
    if facts["attention_mask"] in names:
        arrays[facts["attention_mask"]] = np.ones((1, past + k), _int_dtype(sess, facts["attention_mask"]))
    if facts["position_ids"] in names:
        pos = np.arange(past, past + k)[None]
        arrays[facts["position_ids"]] = pos.astype(_int_dtype(sess, facts["position_ids"]))
    values = {name: ort.OrtValue.ortvalue_from_numpy(arr) for name, arr in arrays.items()}
    for (pk, pv), (ok, ov) in zip(facts["pkv"], facts["present"], strict=True):
        for p, o in ((pk, ok), (pv, ov)):
            kv = (rng.standard_normal((1, hkv, kv_len, hd)) * 0.5).astype(np.float32)
            values[p] = ort.OrtValue.ortvalue_from_numpy(kv)
            # Shared: present *is* the past buffer (GQA writes the new K tokens in place).
            values[o] = values[p] if share else ort.OrtValue.ortvalue_from_shape_and_type(
                [1, hkv, past + k, hd], np.float32)
    values[facts["logits"]] = ort.OrtValue.ortvalue_from_shape_and_type([1, k, facts["vocab"]], np.float32)
    io = sess.io_binding()
    for i in sess.get_inputs():
        io.bind_ortvalue_input(i.name, values[i.name])
    for o in sess.get_outputs():
        io.bind_ortvalue_output(o.name, values[o.name])
    return io, values


def time_calls(model_onnx: Path, ks: list[int], pasts: list[int], reps: int = 50, threads: int = 2,
               share_buffer: bool | None = None) -> list[dict]:
    """Median/p10/p90 wall-clock ms of one session call with ``past`` cached and ``k`` new tokens.

    Uses IOBinding with every input and output preallocated (no allocation per call).
    ``share_buffer`` None follows genai_config.json (``past_present_share_buffer``, which
    onnxruntime-genai honours on CPU for greedy search): the KV buffers are ``max_length``
    long and bound as both past and present. False binds separate past (P) / present (P+K).
    A cell whose call fails gets ``"error"`` instead of timings.
    """
    facts = graph_facts(model_onnx)
    share = facts["past_present_share_buffer"] if share_buffer is None else share_buffer
    sess = session(model_onnx, threads)
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    for past in pasts:
        for k in ks:
            row: dict[str, Any] = {"k": k, "past": past, "binding": "iobinding",
                                   "kv": "shared" if share else "separate"}
            try:
                io, _alive = bind_call(sess, facts, k, past, share, rng)  # keep OrtValues alive
                for _ in range(WARMUP):
                    sess.run_with_iobinding(io)
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    sess.run_with_iobinding(io)
                    times.append((time.perf_counter() - t0) * 1e3)
                p10, med, p90 = np.percentile(times, [10, 50, 90])
                row.update(median_ms=round(float(med), 3), p10_ms=round(float(p10), 3),
                           p90_ms=round(float(p90), 3))
            except Exception as exc:  # noqa: BLE001 - a failing cell is a result, not a crash
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            rows.append(row)
            _log(f"k={k} past={past}: {row.get('median_ms', row.get('error'))}")
    return rows


def check_multi_token(model_onnx: Path, k: int = 4, past: int = 16, threads: int = 2) -> float:
    """Max |logit diff| between one K-token call on a P-token past and K single-token calls.

    Separate (non-shared) buffers, plain ``run``; small means K>1 with a past is computed right.
    """
    facts = graph_facts(model_onnx)
    sess = session(model_onnx, threads)
    rng = np.random.default_rng(1)
    hkv, hd = facts["kv_shape"]
    ids = rng.integers(3, facts["vocab"], (1, k))
    kv0 = {n: (rng.standard_normal((1, hkv, past, hd)) * 0.5).astype(np.float32)
           for pair in facts["pkv"] for n in pair}
    names = {i.name for i in sess.get_inputs()}
    pres = [n for pair in facts["present"] for n in pair]
    pasts = [n for pair in facts["pkv"] for n in pair]

    def call(tok: np.ndarray, kv: dict[str, np.ndarray], p: int) -> tuple[np.ndarray, dict]:
        feed = {facts["input_ids"]: tok.astype(_int_dtype(sess, facts["input_ids"])), **kv}
        if facts["attention_mask"] in names:
            feed[facts["attention_mask"]] = np.ones((1, p + tok.shape[1]), _int_dtype(sess, facts["attention_mask"]))
        if facts["position_ids"] in names:
            pos = np.arange(p, p + tok.shape[1])[None]
            feed[facts["position_ids"]] = pos.astype(_int_dtype(sess, facts["position_ids"]))
        out = sess.run([facts["logits"], *pres], feed)
        return out[0], dict(zip(pasts, out[1:], strict=True))

    full, _ = call(ids, kv0, past)
    kv, steps = kv0, []
    for j in range(k):
        logit, kv = call(ids[:, j:j + 1], kv, past + j)
        steps.append(logit)
    return float(np.abs(full - np.concatenate(steps, axis=1)).max())


def main(argv: list[str] | None = None) -> int:
    """CLI: ensure_venv -> build -> time_calls, print a table (and optionally write JSON)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-dir", type=Path, required=True, help="local HF checkpoint folder")
    ap.add_argument("--work", type=Path, required=True, help="work dir (build output)")
    ap.add_argument("--venv-root", type=Path, default=DEFAULT_ROOT, help="genai-venv parent (default: <repo>/.bench)")
    ap.add_argument("--k", default="1,2,4,8")
    ap.add_argument("--past", default="256,1024")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "int8", "int4"])
    ap.add_argument("--kv", choices=["auto", "shared", "separate"], default="auto",
                    help="KV binding: auto follows genai_config past_present_share_buffer")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    out_dir = args.work / f"genai-{args.hf_dir.resolve().name}-{args.precision}"
    ensure_venv(args.venv_root)
    model = build(args.hf_dir, out_dir, args.precision, root=args.venv_root)
    facts = graph_facts(model)
    share = None if args.kv == "auto" else args.kv == "shared"
    rows = time_calls(model, [int(x) for x in args.k.split(",")], [int(x) for x in args.past.split(",")],
                      reps=args.reps, threads=args.threads, share_buffer=share)
    try:
        diff: float | str = check_multi_token(model, threads=args.threads)
    except Exception as exc:  # noqa: BLE001
        diff = f"error: {exc}"
    report = {"model": str(model), "uses_gqa": facts["uses_gqa"], "attention_ops": facts["attention_ops"],
              "past_present_share_buffer": facts["past_present_share_buffer"],
              "multi_token_with_past_max_abs_diff": diff,
              "inputs": facts["inputs"], "outputs": facts["outputs"], "rows": rows}
    print(f"model: {model}\nattention ops: {facts['attention_ops']}  past_present_share_buffer: "
          f"{facts['past_present_share_buffer']}  K>1-with-past vs K single steps, max|dlogit|: {diff}")
    print(f"{'past':>6} {'k':>3} {'kv':>9} {'median_ms':>10} {'p10_ms':>8} {'p90_ms':>8}")
    for r in rows:
        tail = (f"{r['median_ms']:>10.3f} {r['p10_ms']:>8.3f} {r['p90_ms']:>8.3f}" if "error" not in r
                else f"  ERROR {r['error']}")
        print(f"{r['past']:>6} {r['k']:>3} {r['kv']:>9} {tail}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
