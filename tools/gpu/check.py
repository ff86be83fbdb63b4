"""specdec on a GPU: exactness, host<->device traffic and speed, in one bounded run.

Run by tools/gpu/check.sh on the device machine (``--provider cuda``), or here as a dry run
(``--provider cpu --quick``). Stages, each recorded in ``--out``/results.json as it ends (a
stage that fails records its error and the run goes on; one that would pass ``--budget`` is
skipped and says so):

1. export: the demo pair (float32 and float16, both with its feature head, fused drafting, 8
   rows and an 8-node tree) and SmolLM2-135M-Instruct from its GGUF with the shipped draft and
   head (float16 with fused drafting, 8 rows and the tree; float32), in detached processes at low priority (most
   are exported beforehand by tools/gpu/pack.py and sent whole); a bundle's stages run as soon
   as its export is done, in priority order.
2. exact: per bundle, every drafter's greedy output on the provider against autoregressive
   decoding on the provider and on the CPU (same bundle, same machine), batch 1 and
   ``BatchEngine`` with 8 rows; the feature head and the tree drafters run on the device too.
   cli: ``python -m specdec generate --provider`` against the same command on the CPU.
3. traffic: the target's graphs run under ORT's profiler over device KV buffers: bytes moved
   by Memcpy nodes per call (KV would show here) and the nodes each provider ran; plus the
   bytes the host binds per call (ids, positions, logits), computed from the bindings.
4. speed: tokens/s on the provider, autoregressive and speculative per drafter (and with the
   drafter on the CPU beside the target on the GPU: ``draft_provider``), ``BatchEngine`` at 1
   and 8 rows, and transformers' ``generate`` and assisted generation with the same draft, on
   the same GPU, in the same run (with the load average: exports still running share the CPU).
5. bench: ``specdec bench --provider`` on held-out chat and coding requests through the chat
   template (corpora chat, chat-code), T = 0, the shipped drafter against autoregressive.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

TEXT_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The three most important things to know about photosynthesis are",
    "import numpy as np\n\n\ndef normalize(x):\n",
]


class Run:
    """The results file, written after every stage, and the time budget."""

    def __init__(self, out: Path, budget: float):
        self.out, self.deadline, self.t0 = out, time.monotonic() + budget, time.monotonic()
        self.results: dict = {"stages": {}}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def stage(self, name: str, fn, *args, need: float = 0.0):
        if self.left() < need:
            self.results["stages"][name] = {"skipped": f"{self.left():.0f} s left of the budget, this stage needs ~{need:.0f} s"}
            print(f"[{name}] skipped: budget", flush=True)
            self.save()
            return None
        t = time.monotonic()
        print(f"[{name}] start at {t - self.t0:.0f} s", flush=True)
        try:
            value = fn(*args)
            self.results["stages"][name] = {"seconds": round(time.monotonic() - t, 1), "result": value}
        except Exception as e:  # a stage's failure is a result too; the others still run
            value = None
            self.results["stages"][name] = {"seconds": round(time.monotonic() - t, 1), "error": f"{type(e).__name__}: {e}",
                                            "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
            print(f"[{name}] FAILED: {type(e).__name__}: {e}", flush=True)
        print(f"[{name}] done in {time.monotonic() - t:.0f} s", flush=True)
        self.save()
        return value

    def save(self) -> None:
        self.results["wall_seconds"] = round(time.monotonic() - self.t0, 1)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))


# -- 0. the machine ----------------------------------------------------------------------------


def environment(provider: str) -> dict:
    import onnxruntime as ort

    env = {"python": platform.python_version(), "onnxruntime": ort.__version__, "providers": ort.get_available_providers(),
           "cpus": os.cpu_count(), "provider": provider}  # fmt: skip
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        env["gpu"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        env["gpu"] = f"none ({e})"
    try:
        import torch
        import transformers

        env.update(torch=torch.__version__, transformers=transformers.__version__, torch_cuda=torch.cuda.is_available())
    except ImportError as e:
        env["torch"] = f"missing ({e})"
    if provider.startswith("cuda") and "CUDAExecutionProvider" not in env["providers"]:
        raise RuntimeError(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider: {env['providers']}")
    return env


# -- 1. export -----------------------------------------------------------------------------------


def export_jobs(models: Path, gguf: Path, work: Path, quick: bool) -> dict[str, list[str]]:
    demo = ["--target", str(models / "demo/target"), "--draft", str(models / "demo/draft"), "--max-batch", "8", "--max-seq-len", "512"]
    smol = ["--target", str(gguf), "--draft", str(models / "smollm2-draft"), "--max-seq-len", "512"]
    # Batched and fused graphs are exported per row count, and a 135M target's take minutes
    # each: only what a stage below uses, so that the exports fit the machine's slot.
    # One bundle per model and precision: a bundle with --max-batch 8 holds the batch-1 graphs
    # too, and a model's graphs share one weights file, so batch 1 and 8 travel as one. Not 32
    # rows: SmolLM2's batched graph unrolls attention per row and layer, and its export grew
    # faster than the rows (8 rows: 4 min to trace; 16 rows: over 15 min, on 2 cores; 4x less
    # since the rows are split once, not yet re-timed at 32).
    # SmolLM2's head rides along from the draft folder (float16 too since issue 82).
    head, tree = ["--feature-drafter", str(models / "demo/head")], ["--tree-nodes", "8"]
    jobs = {
        "demo-fp32": [*demo, "--fused-draft", *head],
        "demo-fp16": [*demo, "--dtype", "float16", "--fused-draft", *head, *tree],
        # per-size batched graphs (no If nodes): BatchEngine's calls are captured under cuda-graph; demo-fp16 keeps the rows graph (uncaptured)
        "smollm2-fp16": [*smol, "--dtype", "float16", "--fused-draft", "--max-batch", "8", "--batch-graphs", "per-size", *tree],
        "smollm2-fp32": smol,  # attention runs on the CPU provider: not a GPU deployment, measured for the record
    }
    if quick:  # the dry run: the bundles sent whole
        jobs = {name: jobs[name] for name in ("demo-fp16", "smollm2-fp16")}
    return {name: [*args, "--out", str(work / name), "--overwrite"] for name, args in jobs.items()}


def selected(args) -> dict[str, list[str]]:
    """The export jobs ``--bundles`` names (all by default)."""
    jobs = export_jobs(args.models, args.gguf, args.work, args.quick)
    if not args.bundles:
        return jobs
    names = [n for n in args.bundles.split(",") if n]
    unknown = sorted(set(names) - set(jobs))
    if unknown:
        raise SystemExit(f"--bundles {unknown}: expected names among {sorted(jobs)}")
    return {n: jobs[n] for n in names}


def run_exports(jobs: dict[str, list[str]], work: Path) -> None:
    """Every export in its own process at once, the cores split between them; each one's end
    is written to ``work/NAME.done`` (JSON), which ``wait_export`` reads. Runs detached
    (check.sh --export-early starts it while the last pieces travel)."""
    prebuilt = work.parent / "prebuilt.txt"  # sent whole by tools/gpu/pack.py: not exported here
    skip = set(prebuilt.read_text().split()) if prebuilt.exists() else set()
    jobs = {n: a for n, a in jobs.items() if n not in skip}
    for name in [n for n, a in jobs.items() if not Path(a[a.index("--target") + 1]).exists()]:  # its sources were not sent
        jobs.pop(name)
        (work / f"{name}.done").write_text(json.dumps({"rc": "not run", "seconds": 0, "bundle_mib": 0, "log_tail": "neither sent whole nor its sources"}))
    if not jobs:
        return
    # At most 4 threads each, at low priority: on the device machine the exports run while
    # bundles sent whole are timed, and the load average is recorded beside each timing.
    threads = str(max(1, min(4, (os.cpu_count() or 2) // len(jobs))))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    code = "import sys; from specdec.commands.cli.main import export_main; sys.argv[0] = 'specdec-export'; export_main()"
    procs = {}
    for name, args in jobs.items():
        log = open(work / f"{name}.log", "w")
        cmd = ["nice", "-n", "15", sys.executable, "-c", code, *args]
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work), time.monotonic())
    while procs:  # each one's end as it comes, so that its time is its own
        name = next((n for n, (proc, _) in procs.items() if proc.poll() is not None), None)
        if name is None:
            time.sleep(0.5)
            continue
        proc, started = procs.pop(name)
        rc = proc.returncode
        tail = (work / f"{name}.log").read_text(errors="replace")[-1500:]
        size = sum(f.stat().st_size for f in (work / name).rglob("*") if f.is_file()) if rc == 0 else 0
        done = {"rc": rc, "seconds": round(time.monotonic() - started, 1), "bundle_mib": round(size / 2**20, 1), "log_tail": tail}
        (work / f"{name}.done").write_text(json.dumps(done))


def ensure_exports(args) -> None:
    """Start the exports detached unless check.sh --export-early did (``work/started``)."""
    args.work.mkdir(parents=True, exist_ok=True)
    marker = args.work / "started"
    if marker.exists():
        return
    marker.write_text(str(time.time()))
    cmd = [sys.executable, __file__, "--exports-only", "--provider", args.provider, "--out", str(args.out), "--models", str(args.models),
           "--gguf", str(args.gguf), "--work", str(args.work), *(["--quick"] if args.quick else []),
           *(["--bundles", args.bundles] if args.bundles else [])]  # fmt: skip
    subprocess.Popen(cmd, stdout=open(args.work / "exports.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_export(name: str, work: Path, timeout: float) -> dict:
    done, until = work / f"{name}.done", time.monotonic() + timeout
    while not done.exists():
        if time.monotonic() > until:
            log = work / f"{name}.log"  # none for a bundle sent whole that has not arrived
            tail = log.read_text(errors="replace")[-600:] if log.exists() else "(no log: sent whole, not unpacked yet)"
            raise RuntimeError(f"export {name} not done within the budget; its log ends: {tail}")
        time.sleep(1.0)
    result = json.loads(done.read_text())
    if result["rc"] != 0:
        raise RuntimeError(f"export {name} exited {result['rc']}: {result['log_tail']}")
    result["log_tail"] = result["log_tail"][-300:]
    return result


# -- 2. exactness -----------------------------------------------------------------------------


def prompts_for(bundle: Path, count: int) -> list[list[int]]:
    from specdec.manifest import load_manifest
    from specdec.runtime.text import TextCodec

    m = load_manifest(bundle, "size")
    codec = TextCodec.from_bundle(bundle, m)
    try:
        from specdec.commands.bench.corpus import chat_prompts

        chat = chat_prompts(bundle, m, codec, "chat", count // 2) + chat_prompts(bundle, m, codec, "code", count - count // 2)
    except Exception:  # no chat template (the demo pair): plain text
        chat = []
    return chat or [codec.encode(t) for t in (TEXT_PROMPTS * count)[:count]]


def greedy(dec, prompts, tokens: int, gamma=None) -> list[list[int]]:
    return [dec.generate(p, max_new_tokens=tokens, ignore_eos=True, gamma=gamma).tokens for p in prompts]


def compare(got: list[list[int]], want: list[list[int]]) -> dict:
    """Per pair, None where the tokens are the same, else how many agree before the first difference."""
    from specdec.commands.bench.quality import kept

    diffs = [None if g == w else kept(w, g) for g, w in zip(got, want)]
    return {"equal": all(d is None for d in diffs), "first_diff": diffs}


def exactness(bundle: Path, provider: str, tokens: int) -> dict:
    from specdec.errors import SpecDecError
    from specdec.runtime import SpeculativeDecoder
    from specdec.runtime.batch import BatchEngine
    from specdec.runtime.drafters import DRAFTERS

    prompts = prompts_for(bundle, 4)
    cpu_ar = greedy(SpeculativeDecoder.load(bundle, provider="cpu", drafter="lookup"), prompts, tokens, gamma=0)
    dev = SpeculativeDecoder.load(bundle, provider=provider, drafter="model")  # each drafter below forks its sessions
    dev_ar = greedy(dev, prompts, tokens, gamma=0)
    report = {"prompts": len(prompts), "tokens": tokens, "ar_vs_cpu": compare(dev_ar, cpu_ar), "drafters": {}}
    for name, reg in DRAFTERS.items():
        try:
            dec = dev.fork(name)
        except SpecDecError as e:
            report["drafters"][name] = {"refused": f"{type(e).__name__}: {e}", "tree": reg.tree}
            continue
        got = greedy(dec, prompts, tokens)
        report["drafters"][name] = {"vs_ar_on_device": compare(got, dev_ar), "vs_cpu": compare(got, cpu_ar)}
    m = dev.manifest
    rows = min(8, m.max_batch)
    if rows > 1:  # the bundle's default drafter, and the draft model where that is another
        many = (prompts * 4)[: 2 * rows]
        report["batches"] = []
        for drafter in dict.fromkeys([None, "model"]):
            with BatchEngine(bundle, max_batch=rows, provider=provider, drafter=drafter) as engine:
                got = [r.tokens for r in engine.generate_many(many, max_new_tokens=tokens, ignore_eos=True)]
            report["batches"].append({"rows": rows, "requests": len(many), "drafter": engine.drafter_name,
                                      "vs_ar_on_device": compare(got, (dev_ar * 4)[: len(many)]), "vs_cpu": compare(got, (cpu_ar * 4)[: len(many)])})  # fmt: skip
            if engine.drafter_name == "model":
                break
    return report


def cli(bundle: Path, provider: str, tokens: int) -> dict:
    """``specdec generate --provider`` as a user runs it, against the same command on the CPU."""
    prompt = "The three most important things to know about photosynthesis are"
    out = {}
    for p in dict.fromkeys([provider, "cpu"]):
        cmd = [sys.executable, "-m", "specdec", "generate", str(bundle), "--prompt", prompt, "--max-new-tokens", str(tokens), "--provider", p]
        t = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        out[p] = {"rc": done.returncode, "seconds": round(time.perf_counter() - t, 1), "text": done.stdout[-400:], "stderr": done.stderr[-400:]}
        if done.returncode != 0:
            raise RuntimeError(f"specdec generate --provider {p} exited {done.returncode}: {done.stderr[-400:]}")
    out["same_text"] = out[provider]["text"] == out["cpu"]["text"]
    return out


# -- 3. host<->device traffic -------------------------------------------------------------------


def traffic(bundle: Path, provider: str) -> dict:
    """The target's graph over device KV: what ORT copies per call, from its profile."""
    from specdec.commands.bench.opsplit import profile_events
    from specdec.manifest import load_manifest

    m = load_manifest(bundle, "size")
    name = m.graph("target", "dynamic")[0]
    t = m.target
    calls = {"single": 16, "verify": 16}
    events = profile_events(bundle, m, "target", [(1, calls["single"]), (m.k, calls["verify"])], context=32, provider=provider)
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    runs = 1 + calls["single"] + calls["verify"]
    memcpy = [e for e in nodes if e["args"].get("op_name", "").startswith("Memcpy")]
    by_provider: dict[str, set] = {}
    for e in nodes:
        by_provider.setdefault(e["args"].get("provider", "?"), set()).add(e["args"].get("op_name", "?"))
    kv_bytes = 2 * t.num_layers * t.num_kv_heads * m.max_seq_len * t.head_dim * np.dtype(m.dtype).itemsize
    host = {s: 2 * s * 8 + 8 + s * m.vocab_size * 4 for s in (1, m.k)}  # ids + positions in, seqlens + total, logits out
    return {
        "graph": name, "runs": runs, "kv_cache_bytes": kv_bytes,
        "memcpy_nodes_per_run": round(len(memcpy) / runs, 2),
        "memcpy_bytes_per_run": round(sum(int(e["args"].get("output_size", 0)) for e in memcpy) / runs),
        "memcpy_ops": sorted({(e["args"]["op_name"], e["name"].removesuffix("_kernel_time")) for e in memcpy})[:20],
        "ops_by_provider": {p: sorted(ops) for p, ops in by_provider.items()},
        "bound_host_bytes_per_call": {"1 token": host[1], f"{m.k} tokens (verify)": host[m.k]},
    }  # fmt: skip


# -- 4. speed -----------------------------------------------------------------------------------


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def speed(bundle: Path, provider: str, tokens: int, drafters: list[str], batch_rows: list[int], on_cpu: list[str] = ()) -> dict:
    """``on_cpu``: drafters also measured with the draft model or head on the CPU (``<name>@cpu``)."""
    from specdec.errors import SpecDecError
    from specdec.runtime import SpeculativeDecoder
    from specdec.runtime.batch import BatchEngine

    prompts = prompts_for(bundle, 4)
    out: dict = {"prompts": len(prompts), "tokens": tokens, "single": {}, "batch": {}, "load_average": os.getloadavg()[0]}  # exports still running?
    base = SpeculativeDecoder.load(bundle, provider=provider, drafter="model")
    for drafter in ["ar", *drafters, *(f"{d}@cpu" for d in on_cpu)]:
        try:
            name, placed = drafter.removesuffix("@cpu"), drafter.endswith("@cpu")
            dec = base if drafter == "ar" else base.fork(name) if not placed else \
                SpeculativeDecoder.load(bundle, provider=provider, drafter=name, draft_provider="cpu")  # fmt: skip
        except SpecDecError as e:
            out["single"][drafter] = {"refused": str(e)}
            continue
        gamma = 0 if drafter == "ar" else None
        dec.generate(prompts[0], max_new_tokens=16, ignore_eos=True, gamma=gamma)  # warm-up
        results = []
        seconds = _timed(lambda: results.extend(dec.generate(p, max_new_tokens=tokens, ignore_eos=True, gamma=gamma) for p in prompts))
        new = sum(len(r.tokens) for r in results)
        acc = [r.stats.acceptance_rate for r in results if r.stats.acceptance_rate is not None]
        out["single"][drafter] = {"tok_s": round(new / seconds, 1), "acceptance": round(float(np.mean(acc)), 3) if acc else None}
    ar = out["single"]["ar"]["tok_s"]
    for d, r in out["single"].items():
        if "tok_s" in r:
            r["speedup"] = round(r["tok_s"] / ar, 2)
    if batch_rows:  # one engine for every row count: a rows graph holds them all, and its load is the slow part
        try:
            t = time.perf_counter()
            with BatchEngine(bundle, max_batch=max(batch_rows), provider=provider, max_queue=max(batch_rows)) as engine:
                engine.generate_many(prompts[:1], max_new_tokens=8, ignore_eos=True)  # warm-up
                out["batch_load_seconds"] = round(time.perf_counter() - t, 1)
                for rows in batch_rows:
                    wave = (prompts * rows)[:rows]  # `rows` requests in flight together, four waves of them
                    for mode, gamma in (("ar", 0), ("spec", None)):
                        engine.generate_many(wave, max_new_tokens=4, ignore_eos=True, gamma=gamma)  # this row count's first calls
                        results = []
                        seconds = _timed(lambda: [results.extend(engine.generate_many(wave, max_new_tokens=tokens // 2, ignore_eos=True, gamma=gamma)) for _ in range(4)])
                        out["batch"][f"{rows} rows {mode}"] = {"drafter": engine.drafter_name if gamma is None else "-", "requests": 4 * rows,
                                                              "tok_s": round(sum(len(r.tokens) for r in results) / seconds, 1)}  # fmt: skip
        except Exception as e:  # the single-row figures above still count
            out["batch_error"] = f"{type(e).__name__}: {e}"
    return out


def bench(bundle: Path, provider: str, out: Path, quick: bool) -> dict:
    """``specdec bench`` as a user runs it on held-out chat and coding requests (T = 0): the shipped
    drafter (feature-lookup at γ 4) against autoregressive on the same GPU; each report in
    ``out/bench-<corpus>``, the ratios returned."""
    sizes = ["--prompts", "2", "--tokens", "32", "--rounds", "1"] if quick else ["--prompts", "4", "--tokens", "128", "--rounds", "2"]
    found = {}
    for corpus in ("chat", "chat-code"):
        cmd = [sys.executable, "-m", "specdec", "bench", str(bundle), "--provider", provider, "--corpus", corpus, "--drafters", "feature-lookup",
               "--gammas", "4", "--temperatures", "0", *sizes, "--out", str(out / f"bench-{corpus}")]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        if done.returncode != 0:
            raise RuntimeError(f"specdec bench --corpus {corpus} exited {done.returncode}: {done.stderr[-600:]}")
        found[corpus] = json.loads((out / f"bench-{corpus}" / "results.json").read_text())
    return found


def transformers_speed(bundle: Path, gguf: Path, draft: Path, dtype: str, tokens: int) -> dict:
    """transformers' generate, plain and assisted by the same draft, greedy, on the GPU."""
    import torch
    from transformers import AutoConfig

    from specdec.commands.distill.hf import load_model
    from specdec.export import shared_draft

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tdtype = {"float16": torch.float16, "float32": torch.float32}[dtype]
    target = load_model(gguf)
    # the shipped draft borrows the target's embedding and output rows (export/shared_draft.py),
    # as it does in the bundle: the same draft model, in transformers
    assistant = shared_draft.load(draft, AutoConfig.from_pretrained(str(draft)), target).to(dev, tdtype)
    target = target.to(dev, tdtype)
    prompts = prompts_for(bundle, 4)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    out = {"device": dev, "dtype": dtype, "prompts": len(prompts), "tokens": tokens, "load_average": os.getloadavg()[0]}
    outputs = {}
    for mode, kw in (("generate", {}), ("assisted", {"assistant_model": assistant})):
        def run(n: int, kw=kw, mode=mode) -> int:
            new, outputs[mode] = 0, []
            for p in prompts:
                ids = torch.tensor([p], device=dev)
                with torch.inference_mode():
                    seq = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                          eos_token_id=None, pad_token_id=0, **kw)  # no EOS: n tokens, as ignore_eos  # fmt: skip
                new += seq.shape[1] - ids.shape[1]
                outputs[mode].append(seq[0, ids.shape[1] :].tolist())
            sync()
            return new

        run(8)  # warm-up
        t = time.perf_counter()
        new = run(tokens)
        out[mode] = {"tok_s": round(new / (time.perf_counter() - t), 1)}
    out["assisted_equals_generate"] = compare(outputs["assisted"], outputs["generate"])
    return out


# -- the run ------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", default="cuda", choices=["cuda", "cuda-graph", "cpu"])
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; stages that would pass it are skipped")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", type=Path, required=True, help="the checkout's models/ folder")
    ap.add_argument("--gguf", type=Path, required=True, help="SmolLM2-135M-Instruct's GGUF")
    ap.add_argument("--work", type=Path, required=True, help="where bundles are exported")
    ap.add_argument("--quick", action="store_true", help="the dry run: two bundles, fewer tokens")
    ap.add_argument("--bundles", default=None, help="comma-separated names among the export jobs to run (default: all)")
    ap.add_argument("--stages", default=None, help="comma-separated stage kinds to run (exact, cli, traffic, speed, transformers; default: all)")
    ap.add_argument("--exports-only", action="store_true", help="run the exports and exit (started detached by ensure_exports)")
    args = ap.parse_args()
    if args.exports_only:
        run_exports(selected(args), args.work)
        return
    run = Run(args.out, args.budget)
    p = args.provider
    from specdec.commands.bench.report import provenance

    stages = f" --stages {args.stages}" if args.stages else ""
    run.results["provenance"] = {**provenance(), "command": f"python tools/gpu/check.py --provider {p} --budget {args.budget:.0f}{stages}"}
    run.results["environment"] = run.stage("environment", environment, p)
    if run.results["environment"] is None:
        return
    jobs = selected(args)
    ensure_exports(args)
    tokens = 24 if args.quick else 48
    speed_tokens = 32 if args.quick else 128
    draft = args.models / "smollm2-draft"
    # In priority order: a bundle's stages run once its export is done, while the later ones export.
    rows = [1, 8]  # BatchEngine's rows, as many as the bundle has (see export_jobs)
    drafters = ["model", "model-steps", "lookup", "feature", "feature-lookup", "feature-tree", "lookup-tree"]
    plan = {
        "smollm2-fp16": [("exact", exactness, (p, tokens), 40), ("cli", cli, (p, 32), 20), ("traffic", traffic, (p,), 20),
                         ("speed", speed, (p, speed_tokens, drafters, rows, ["feature-lookup", "model"]), 90),
                         ("bench", bench, (p, args.out, args.quick), 60),
                         ("transformers", transformers_speed, (args.gguf, draft, "float16", speed_tokens), 60)],
        "demo-fp16": [("exact", exactness, (p, tokens), 30)],
        "demo-fp32": [("exact", exactness, (p, tokens), 30)],
        "smollm2-fp32": [("exact", exactness, (p, tokens), 40), ("traffic", traffic, (p,), 20),
                         ("speed", speed, (p, speed_tokens, ["model", "feature-lookup", "lookup"], []), 60),
                         ("transformers", transformers_speed, (args.gguf, draft, "float32", speed_tokens), 60)],
    }  # fmt: skip
    pending = [name for name in plan if name in jobs]
    while pending:  # the first bundle in priority order whose export has ended, as soon as one has
        name = next((n for n in pending if (args.work / f"{n}.done").exists()), None)
        if name is None:
            if run.left() < 45:
                for n in pending:
                    run.stage(f"export {n}", wait_export, n, args.work, 0)
                break
            time.sleep(1.0)
            continue
        pending.remove(name)
        if run.stage(f"export {name}", wait_export, name, args.work, 0) is None:
            continue
        for stage, fn, rest, need in plan[name]:
            if args.stages and stage not in args.stages.split(","):
                continue
            run.stage(f"{stage} {name}", fn, args.work / name, *rest, need=need)
    print(json.dumps({k: ("ok" if "result" in v else v.get("error") or v.get("skipped")) for k, v in run.results["stages"].items()}, indent=1))


if __name__ == "__main__":
    main()
