#!/usr/bin/env python3
"""Decoding speed of the peers a user would otherwise reach for, on one target/draft pair.

For ONE pair of Hugging Face Llama checkpoints (folders with config.json, float16/float32
safetensors and tokenizer files) this measures end-to-end decoding speed of:

* ``specdec`` (with ``--bundle``, a bundle exported from the same pair) specdec's own runtime in
              the same interleaved run: autoregressive, draft model at γ = K, adaptive γ, prompt
              lookup, n-gram table and hierarchical drafters (``SpecdecPeer``).
* ``hf``      transformers ``generate`` on PyTorch CPU: the target alone (autoregressive) and
              assisted generation (``assistant_model=draft``; with sampling, transformers uses
              speculative sampling).
* ``optimum`` optimum-onnx ``ORTModelForCausalLM`` (exported once with ``export=True`` into
              ``.bench/peers/optimum/``): the target alone, through the same ``generate``.
* ``genai``   onnxruntime-genai 0.18 (in the private venv ``.bench/genai-venv``; its model
              builder writes the target and draft graphs into ``.bench/peers/genai/``): the
              target alone, genai's draft-model speculative decoding (a composite
              ``genai_config.json`` with ``model.type = "speculative"`` and a ``model.draft``
              decoder, ``speculative.max_draft_tokens`` = K) and its n-gram decoding (no
              draft; ``set_speculative_options(ngram_size=N, max_draft_tokens=K)``). It runs
              in a worker process of the venv's python that answers JSON lines.

so that the numbers can sit next to ``specdec bench`` (``specdec.runtime.bench``), whose prompt
set this reuses: ``--prompts`` held-out CPython stdlib files, the first ``--prompt-tokens``
tokens of each (the target's tokenizer via ``transformers.AutoTokenizer``, special tokens as
transformers adds them). Every request asks for exactly ``--tokens`` new tokens with EOS
ignored (transformers: no EOS id given to ``generate``; genai: ``min_length = max_length``),
greedy (T = 0) and pure sampling at T = 1 (no top-k / top-p in any peer). torch threads and
every ONNX Runtime session's intra-op threads are ``--threads``. Each (peer, mode, T) makes one
8-token warm-up call; then rounds are interleaved: each round decodes every prompt once with
every (peer, mode, T), seeded by round and prompt, so machine noise hits all alike.

What is timed is decoding only: from the moment the first new token(s) are available (prefill
done) to the last token, and the tokens counted are those that appeared after that moment.
For transformers and optimum the moments come from a streamer (``put`` is called per step, or
per accepted chunk in assisted generation); for genai from ``generate_next_token`` and, in its
speculative modes, ``get_speculative_stats()["tokens_buffered"]`` (a round's extra tokens are
buffered and handed out one per call, so they are not counted as decoded after the first one).
``specdec bench`` instead counts all N tokens over total minus prefill time; for N >> 1 the
two agree.

Reported per (peer, mode, T): tokens/s, speedup over the same peer's autoregressive run at the
same T, new tokens per target forward pass (prefill pass included; transformers: counted with a
forward hook; genai: from its stats) and the acceptance statistics genai reports (accepted /
evaluated draft tokens; n-gram lookup hit rate). transformers reports no acceptance statistics.
At T = 0 the table also says on how many prompts each (peer, mode) wrote exactly the tokens of
the first autoregressive peer (round 0): exact speculative decoding must agree with it, up to
floating-point near-ties between runtimes. A mode that a peer lacks or that fails is listed
with the reason; no number is ever made up.

Things to know when reading the numbers: genai samples at T = 1 with ``top_k = 0`` (the full
vocabulary), which its CPU search does much more slowly than greedy or top-k sampling (about
0.5 ms per token at a 4096-token vocabulary, measured), so genai's T = 1 rows include that
cost. transformers adapts its assistant's settings across calls; they are reset before every
request so that the order of requests does not matter. Build outputs are cached under
``.bench/peers/`` (keyed by checkpoint path, file sizes and mtimes).

Reproduce (writes .bench/peers/results.json and results.md, prints the table)::

    python tools/bench_peers.py --target DIR --draft DIR [--bundle BUNDLE] [--prompts 4] [--prompt-tokens 64] \
        [--tokens 128] [--rounds 2] [--threads 2] [--only hf,optimum,genai,specdec] \
        [--draft-tokens K] [--ngram-size 3]
    specdec bench BUNDLE --prompts 4 --prompt-tokens 64 --tokens 128 --rounds 2 --threads 2

``--draft-tokens K`` pins the proposal width of every speculative peer (transformers:
``num_assistant_tokens = K`` with the constant schedule and no confidence early-stop; genai:
``max_draft_tokens = K``); by default each peer keeps its own default (transformers 20 with a
0.4 confidence early-stop; genai 4), as a user would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / ".bench" / "peers"
VENV_ROOT = REPO / ".bench"  # genai_baseline.ensure_venv puts genai-venv/ here
VENV_PYTHON = VENV_ROOT / "genai-venv" / "bin" / "python"
PEERS = ("hf", "optimum", "genai", "specdec")  # specdec last: its shared ORT pool forbids later per-session pools
WARMUP_TOKENS = 8
GENAI_DEFAULT_K = 4


def log(msg: str) -> None:
    """Progress to stderr (stdout is the table; in the genai worker, the reply channel)."""
    print(f"[bench_peers] {msg}", file=sys.stderr, flush=True)


def checkpoint_key(*dirs: Path) -> str:
    """12 hex digits naming a cache folder after checkpoint folders: their paths and the name,
    size and mtime of their config and weight files (an edited checkpoint gets a fresh build)."""
    h = hashlib.sha256()
    for d in dirs:
        h.update(str(d.resolve()).encode())
        for f in sorted(d.glob("*.json")) + sorted(d.glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


class ModeUnavailable(Exception):
    """A peer cannot run a mode; the message says why (it goes into the table)."""


@dataclass
class Sample:
    """One timed request: decoding seconds, tokens decoded in them, peer statistics."""

    seconds: float
    tokens: int
    new_tokens: int
    stats: dict[str, float] = field(default_factory=dict)
    ids: list[int] = field(default_factory=list)  # the new tokens themselves


@dataclass
class Tally:
    """Sums over every request of one (peer, mode, T)."""

    seconds: float = 0.0
    tokens: int = 0
    new_tokens: int = 0
    requests: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)  # round 0's new tokens per prompt

    def add(self, s: Sample) -> None:
        self.seconds += s.seconds
        self.tokens += s.tokens
        self.new_tokens += s.new_tokens
        self.requests += 1
        for k, v in s.stats.items():
            self.stats[k] = self.stats.get(k, 0.0) + v


# --------------------------------------------------------------------------- transformers / optimum


class StepClock:
    """A ``generate`` streamer that timestamps each ``put``: the first is the prompt, the
    second the first new token(s) (after prefill); ``end`` marks the last."""

    def __init__(self) -> None:
        self.puts: list[tuple[float, int]] = []
        self.t_end: float | None = None

    def put(self, value) -> None:
        self.puts.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        self.t_end = time.perf_counter()

    def sample(self, ids: list[int], stats: dict[str, float]) -> Sample:
        """Decoding after the first new token(s): the time since, the tokens since."""
        if len(self.puts) < 2 or self.t_end is None:
            raise RuntimeError("generate did not stream its tokens; cannot split prefill from decoding")
        t_first, first = self.puts[1]
        return Sample(self.t_end - t_first, len(ids) - first, len(ids), stats, ids)


def hf_generation_config(tokens: int, temperature: float, pad: int | None):
    """Exactly ``tokens`` new tokens; greedy at T = 0, else pure sampling at T.

    EOS is ignored by giving ``generate`` no EOS id at all: ``min_new_tokens`` would be the
    usual way, but transformers 4.57's assisted generation refuses the MinLengthLogitsProcessor
    it turns into ("Passing `MinLengthLogitsProcessor` when using assisted_generation is
    disabled"), and both modes must be treated alike.
    """
    from transformers import GenerationConfig

    common = dict(max_new_tokens=tokens, eos_token_id=None, pad_token_id=pad)
    if temperature == 0:
        return GenerationConfig(do_sample=False, **common)
    return GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, **common)


def pad_id(model_dir: Path) -> int | None:
    """The checkpoint's pad token id, else its (first) EOS id: batch 1 never pads, but
    ``generate`` wants one."""
    cfg = json.loads((model_dir / "config.json").read_text())
    pad = cfg.get("pad_token_id")
    pad = cfg.get("eos_token_id") if pad is None else pad
    return pad[0] if isinstance(pad, list) else pad


def hf_generate(model, prompt: list[int], tokens: int, temperature: float, seed: int, pad, **kwargs) -> tuple[StepClock, list[int]]:
    """One seeded ``generate`` call with a StepClock; returns the clock and the new tokens."""
    import torch

    ids = torch.tensor([prompt], dtype=torch.long)
    clock = StepClock()
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=clock, use_model_defaults=False,  # keep the model's EOS out
                             generation_config=hf_generation_config(tokens, temperature, pad), **kwargs)
    return clock, out[0, len(prompt):].tolist()


class HFPeer:
    """transformers ``generate`` on PyTorch CPU: autoregressive and assisted (draft) decoding."""

    name = "hf"
    modes = ("autoregressive", "assisted")

    def __init__(self, target: Path, draft: Path, threads: int, draft_tokens: int | None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        load = dict(torch_dtype=torch.float32)  # CPU: fp32 compute, as the ORT peers
        self.target = AutoModelForCausalLM.from_pretrained(target, **load).eval()
        self.draft = AutoModelForCausalLM.from_pretrained(draft, **load).eval()
        self.pad = pad_id(target)
        self.target_passes = 0
        self.target.register_forward_hook(self._count)
        gc = self.draft.generation_config
        if draft_tokens is not None:
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = draft_tokens, "constant", 0.0
        # transformers adapts these across calls; restore them per request so order does not matter.
        self.assistant_settings = (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold)
        self.settings = {"num_assistant_tokens": gc.num_assistant_tokens, "schedule": gc.num_assistant_tokens_schedule,
                         "assistant_confidence_threshold": gc.assistant_confidence_threshold, "torch_threads": threads}

    def _count(self, *_args) -> None:
        self.target_passes += 1

    def decode(self, mode: str, temperature: float, prompt: list[int], tokens: int, seed: int) -> Sample:
        """One request; assisted mode also counts the target's forward passes."""
        kwargs = {}
        if mode == "assisted":
            gc = self.draft.generation_config
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = self.assistant_settings
            kwargs["assistant_model"] = self.draft
        self.target_passes = 0
        clock, ids = hf_generate(self.target, prompt, tokens, temperature, seed, self.pad, **kwargs)
        stats = {"target_passes": float(self.target_passes)} if mode == "assisted" else {}
        return clock.sample(ids, stats)

    def close(self) -> None:
        pass


class OptimumPeer:
    """optimum-onnx ``ORTModelForCausalLM`` (CPU EP) of the target, autoregressive."""

    name = "optimum"
    modes = ("autoregressive",)

    def __init__(self, target: Path, threads: int) -> None:
        import onnxruntime as ort
        from optimum.onnxruntime import ORTModelForCausalLM

        cache = OUT / "optimum" / f"{target.resolve().name}-{checkpoint_key(target)}"
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        kw = dict(session_options=so, provider="CPUExecutionProvider")
        if not (cache / "model.onnx").is_file():
            log(f"optimum: exporting {target} -> {cache}")
            ORTModelForCausalLM.from_pretrained(target, export=True, **kw).save_pretrained(cache)
        self.model = ORTModelForCausalLM.from_pretrained(cache, **kw)
        self.pad = pad_id(target)
        self.settings = {"cache": str(cache), "ort_intra_op_threads": threads}

    def decode(self, mode: str, temperature: float, prompt: list[int], tokens: int, seed: int) -> Sample:
        clock, ids = hf_generate(self.model, prompt, tokens, temperature, seed, self.pad)
        return clock.sample(ids, {})

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- specdec itself


class SpecdecPeer:
    """specdec's own runtime on a bundle exported from the same pair, in the same interleaved run:
    autoregressive (γ = 0), the draft model at γ = K, adaptive γ, prompt lookup, n-gram table,
    hierarchical (draft model + prompt lookup). K = ``--draft-tokens`` or the bundle's γ."""

    name = "specdec"
    modes = ("autoregressive", "draft-model", "draft-model-adaptive", "prompt-lookup", "ngram", "hierarchical")
    DRAFTER = {"draft-model": "model", "draft-model-adaptive": "model", "prompt-lookup": "lookup", "ngram": "ngram", "hierarchical": "hierarchical"}

    def __init__(self, bundle: Path, threads: int, draft_tokens: int | None) -> None:
        from specdec.engines.ort import share_threads
        from specdec.runtime.decoder import SpeculativeDecoder

        share_threads(threads)  # as the specdec CLI does; started last, since ORT then refuses per-session pools
        base = SpeculativeDecoder.load(bundle, threads=threads)
        self.decoders = {d: base.fork(drafter=d) for d in set(self.DRAFTER.values())}
        self.decoders["model"] = base
        self.k = draft_tokens or base.manifest.gamma
        if self.k > base.manifest.gamma:
            raise ModeUnavailable(f"--draft-tokens {self.k} exceeds the bundle's gamma {base.manifest.gamma}")
        self.settings = {"bundle": str(bundle), "gamma": self.k, "ort_intra_op_threads": threads}

    def decode(self, mode: str, temperature: float, prompt: list[int], tokens: int, seed: int) -> Sample:
        gamma = 0 if mode == "autoregressive" else "auto" if mode.endswith("adaptive") else self.k
        dec = self.decoders[self.DRAFTER.get(mode, "model")]
        res = dec.generate(prompt, max_new_tokens=tokens, gamma=gamma, temperature=temperature, seed=seed, ignore_eos=True)
        s = res.stats
        stats = {"target_passes": s.target_calls + 1, "draft_tokens_accepted": s.accepted, "draft_tokens_evaluated": s.drafted}
        return Sample(s.total_seconds - s.prefill_seconds, s.new_tokens, s.new_tokens, stats if gamma != 0 else {"target_passes": s.target_calls + 1}, res.tokens)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- onnxruntime-genai


def genai_models(target: Path, draft: Path, k: int) -> Path:
    """Builder graphs of target and draft plus a composite speculative config; return its folder.

    Layout: ``<pair>/target``, ``<pair>/draft`` (model builder output, fp32, CPU EP) and
    ``<pair>/genai_config.json``: the target's config with ``model.type = "speculative"``,
    ``model.draft`` = the draft's decoder block and ``speculative.max_draft_tokens = k``.
    genai 0.18 rejects ``..`` in model filenames, hence the draft and target below the config.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from genai_baseline import build  # noqa: E402 - sibling tool: venv + model builder

    pair = OUT / "genai" / f"{target.resolve().name}-{draft.resolve().name}-{checkpoint_key(target, draft)}"
    for name, src in (("target", target), ("draft", draft)):
        build(src, pair / name, "fp32", root=VENV_ROOT)
    cfg = json.loads((pair / "target" / "genai_config.json").read_text())
    drafted = json.loads((pair / "draft" / "genai_config.json").read_text())["model"]
    if drafted["vocab_size"] != cfg["model"]["vocab_size"]:
        raise ValueError(f"target vocab {cfg['model']['vocab_size']} != draft vocab {drafted['vocab_size']}")
    cfg["model"]["type"] = "speculative"
    cfg["model"]["decoder"]["filename"] = "target/" + cfg["model"]["decoder"]["filename"]
    cfg["model"]["draft"] = dict(drafted["decoder"], filename="draft/" + drafted["decoder"]["filename"])
    cfg["speculative"] = {"max_draft_tokens": k}
    (pair / "genai_config.json").write_text(json.dumps(cfg, indent=2))
    return pair


class GenaiPeer:
    """onnxruntime-genai through a worker in its venv (``bench_peers.py --genai-worker``)."""

    name = "genai"
    modes = ("autoregressive", "speculative-draft", "speculative-ngram")

    def __init__(self, target: Path, draft: Path, threads: int, draft_tokens: int | None, ngram_size: int) -> None:
        if not VENV_PYTHON.exists():
            raise ModeUnavailable(f"no onnxruntime-genai venv at {VENV_PYTHON.parent.parent} (tools/genai_baseline.py creates it)")
        k = GENAI_DEFAULT_K if draft_tokens is None else draft_tokens
        pair = genai_models(target, draft, k)
        spec = {"pair": str(pair), "threads": threads, "k": k, "ngram_size": ngram_size}
        self.proc = subprocess.Popen([str(VENV_PYTHON), str(Path(__file__).resolve()), "--genai-worker", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        hello = self._ask({"cmd": "hello"})
        self.unavailable: dict[str, str] = hello["unavailable"]
        self.settings = {"version": hello["version"], "max_draft_tokens": k, "ngram_size": ngram_size,
                         "ort_intra_op_threads": threads, "models": str(pair)}

    def _ask(self, request: dict) -> dict:
        """One JSON line out, one back; a dead worker raises with its exit code."""
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"genai worker exited (rc={self.proc.wait()})")
        return json.loads(line)

    def decode(self, mode: str, temperature: float, prompt: list[int], tokens: int, seed: int) -> Sample:
        if mode in self.unavailable:
            raise ModeUnavailable(self.unavailable[mode])
        reply = self._ask({"cmd": "decode", "mode": mode, "temperature": temperature, "prompt": prompt,
                           "tokens": tokens, "seed": seed})
        if "error" in reply:
            raise ModeUnavailable(reply["error"])
        return Sample(reply["seconds"], reply["tokens"], reply["new_tokens"], reply["stats"], reply["ids"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


# The worker half runs inside the genai venv: only the standard library, numpy and onnxruntime_genai.

SPEC_STATS = ("draft_tokens_proposed", "draft_tokens_evaluated", "draft_tokens_accepted", "target_forward_passes",
              "standard_fallback_steps", "draft_forward_passes", "rounds", "ngram_lookup_hits", "ngram_lookup_misses")


def genai_load(og, folder: Path, threads: int, with_draft: bool):
    """An ``og.Model`` with every session's intra-op threads set (a config overlay)."""
    config = og.Config(str(folder))
    blocks = ("decoder", "draft") if with_draft else ("decoder",)
    config.overlay(json.dumps({"model": {b: {"session_options": {"intra_op_num_threads": threads}} for b in blocks}}))
    return og.Model(config)


def genai_decode(og, model, mode: str, temperature: float, prompt: list[int], tokens: int, seed: int,
                 k: int, ngram_size: int) -> dict:
    """One request through ``og.Generator``; times decoding after the first token is out."""
    import numpy as np

    params = og.GeneratorParams(model)
    total = len(prompt) + tokens
    search: dict[str, Any] = dict(max_length=total, min_length=total, do_sample=temperature > 0)
    if temperature > 0:
        search.update(temperature=temperature, top_k=0, top_p=1.0, random_seed=seed)  # top_k 0: full vocabulary
    params.set_search_options(**search)
    speculative = mode != "autoregressive"
    if mode == "speculative-ngram":
        params.set_speculative_options(ngram_size=ngram_size, max_draft_tokens=k)
    elif mode == "speculative-draft":
        params.set_speculative_options(max_draft_tokens=k)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray([prompt], dtype=np.int32))
    gen.generate_next_token()
    t_first = time.perf_counter()
    out_first = 1 + (int(gen.get_speculative_stats().get("tokens_buffered", 0)) if speculative else 0)
    while not gen.is_done():
        gen.generate_next_token()
    t_end = time.perf_counter()
    ids = gen.get_sequence(0)[len(prompt):].tolist()
    stats = {}
    if speculative:
        got = gen.get_speculative_stats()
        stats = {key: float(got.get(key, 0)) for key in SPEC_STATS}
    return {"seconds": t_end - t_first, "tokens": len(ids) - out_first, "new_tokens": len(ids), "stats": stats, "ids": ids}


def genai_worker(spec: dict) -> int:
    """Serve ``decode`` requests (JSON lines on stdin) until stdin closes.

    Loads the plain target (autoregressive and n-gram modes) and the composite speculative
    model (draft mode). A mode that cannot load is reported in ``hello`` with the reason.
    """
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the library prints goes to stderr, not into the reply channel
    import onnxruntime_genai as og

    pair, threads = Path(spec["pair"]), spec["threads"]
    unavailable: dict[str, str] = {}
    models: dict[str, Any] = {}
    try:
        models["autoregressive"] = models["speculative-ngram"] = genai_load(og, pair / "target", threads, False)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        for m in ("autoregressive", "speculative-ngram"):
            unavailable[m] = f"target did not load: {exc}"
    if not hasattr(og.GeneratorParams, "set_speculative_options"):
        for m in ("speculative-draft", "speculative-ngram"):
            unavailable[m] = f"onnxruntime-genai {og.__version__} has no GeneratorParams.set_speculative_options"
    else:
        try:
            models["speculative-draft"] = genai_load(og, pair, threads, True)
        except Exception as exc:  # noqa: BLE001
            unavailable["speculative-draft"] = f"composite speculative model did not load: {exc}"
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "hello":
            out: dict[str, Any] = {"version": og.__version__, "unavailable": unavailable}
        else:
            try:
                out = genai_decode(og, models[req["mode"]], req["mode"], req["temperature"], req["prompt"],
                                   req["tokens"], req["seed"], spec["k"], spec["ngram_size"])
            except Exception as exc:  # noqa: BLE001 - the client marks the mode unavailable
                out = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        reply.write(json.dumps(out) + "\n")
    return 0


# --------------------------------------------------------------------------- the benchmark

PEER_CLASSES = {"specdec": SpecdecPeer, "hf": HFPeer, "optimum": OptimumPeer, "genai": GenaiPeer}


def prompts_for(target: Path, count: int, length: int) -> list[list[int]]:
    """``specdec bench``'s prompts, tokenized by the target's own tokenizer."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from specdec.runtime.bench import held_out_prompts

    hf_logging.set_verbosity_error()  # whole stdlib files exceed model_max_length; only a prefix is used
    tok = AutoTokenizer.from_pretrained(target)
    prompts = held_out_prompts(lambda text: tok(text)["input_ids"], count, length)
    if not prompts:
        raise SystemExit("no held-out stdlib file is long enough for a prompt; lower --prompt-tokens")
    return prompts


Key = tuple[str, str, float]  # (peer, mode, T)


def start_peers(args) -> tuple[list, dict[Key, str]]:
    """The requested peers; a peer that cannot start is recorded (with why) instead."""
    makers = {
        "specdec": lambda: SpecdecPeer(args.bundle, args.threads, args.draft_tokens),
        "hf": lambda: HFPeer(args.target, args.draft, args.threads, args.draft_tokens),
        "optimum": lambda: OptimumPeer(args.target, args.threads),
        "genai": lambda: GenaiPeer(args.target, args.draft, args.threads, args.draft_tokens, args.ngram_size),
    }
    peers, unavailable = [], {}
    for name in args.only:
        log(f"starting {name}")
        try:
            peers.append(makers[name]())
        except Exception as exc:  # noqa: BLE001 - a missing peer is a result
            log(f"{name} unavailable: {one_line(exc)}")
            for mode in PEER_CLASSES[name].modes:
                for t in args.temps:
                    unavailable[(name, mode, t)] = one_line(exc)
    return peers, unavailable


def one_line(exc: Exception) -> str:
    """``Type: first line of the message`` (ModeUnavailable: the message alone)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return text if isinstance(exc, ModeUnavailable) else f"{type(exc).__name__}: {text}"


def attempt(peer, mode: str, t: float, prompt: list[int], tokens: int, seed: int, unavailable: dict[Key, str]) -> Sample | None:
    """``peer.decode``, or None once (peer, mode, T) has failed; the first failure is recorded."""
    key = (peer.name, mode, t)
    if key in unavailable:
        return None
    try:
        return peer.decode(mode, t, prompt, tokens, seed)
    except Exception as exc:  # noqa: BLE001 - one failing mode must not sink the others
        unavailable[key] = one_line(exc)
        log(f"{peer.name}/{mode}/T={t:g} unavailable: {unavailable[key]}")
        return None


def measure(peers: list, prompts: list[list[int]], temps: list[float], tokens: int, rounds: int,
            unavailable: dict[Key, str]) -> dict[Key, Tally]:
    """Warm-up once per (peer, mode, T), then interleaved rounds over prompts, T, peers and modes.

    Seeds are 1000 * round + prompt index, the same for every peer (``specdec bench``'s too).
    Round 0's outputs are kept per prompt for the greedy agreement check.
    """
    tallies: dict[Key, Tally] = {}
    for peer in peers:
        for mode in peer.modes:
            for t in temps:
                attempt(peer, mode, t, prompts[0], WARMUP_TOKENS, 0, unavailable)
    for r in range(rounds):
        log(f"round {r + 1}/{rounds}")
        for i, prompt in enumerate(prompts):
            for t in temps:
                for peer in peers:
                    for mode in peer.modes:
                        s = attempt(peer, mode, t, prompt, tokens, 1000 * r + i, unavailable)
                        if s is not None:
                            tally = tallies.setdefault((peer.name, mode, t), Tally())
                            tally.add(s)
                            if r == 0:
                                tally.outputs[i] = s.ids
    return tallies


def ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def target_passes(tally: Tally) -> float | None:
    """Target forward passes over all requests, the prefill pass included (None: not known)."""
    st = tally.stats
    if "target_forward_passes" in st:  # genai: verify/re-anchor passes + standard steps, plus the prefill
        return st["target_forward_passes"] + st["standard_fallback_steps"] + tally.requests
    return st.get("target_passes")  # transformers' forward hook (assisted mode only)


def greedy_agreement(tallies: dict[Key, Tally], order: list[tuple[str, str]]) -> tuple[str | None, dict[tuple[str, str], str]]:
    """For T = 0: on how many prompts each (peer, mode) wrote exactly the reference's tokens.

    The reference is the first autoregressive peer measured at T = 0 (exact speculative
    decoding must agree with it up to floating-point ties between runtimes).
    """
    ref = next((p for p, m in order if m == "autoregressive" and (p, m, 0.0) in tallies), None)
    if ref is None:
        return None, {}
    want = tallies[(ref, "autoregressive", 0.0)].outputs
    out = {}
    for p, m in order:
        got = tallies.get((p, m, 0.0))
        if got is not None:
            same = sum(got.outputs.get(i) == ids for i, ids in want.items())
            out[(p, m)] = f"{same}/{len(want)}"
    return f"{ref} autoregressive", out


def summarize(tallies: dict[Key, Tally], unavailable: dict[Key, str], order: list[tuple[str, str]],
              temps: list[float]) -> tuple[list[dict], str | None]:
    """One row per (peer, mode, T): speed, speedup over the peer's own autoregressive run, stats."""
    ref, agree = greedy_agreement(tallies, order)
    rows = []
    for peer, mode in order:
        for t in temps:
            row: dict[str, Any] = {"peer": peer, "mode": mode, "T": t}
            tally = tallies.get((peer, mode, t))
            if (peer, mode, t) in unavailable or tally is None:
                row["unavailable"] = unavailable.get((peer, mode, t), "no measurement")
                rows.append(row)
                continue
            base = tallies.get((peer, "autoregressive", t))
            tps = tally.tokens / tally.seconds
            st = tally.stats
            passes = target_passes(tally)
            row.update(tokens_per_s=tps, seconds=tally.seconds, tokens=tally.tokens, requests=tally.requests,
                       speedup=ratio(tps, base.tokens / base.seconds) if base and mode != "autoregressive" else None,
                       tokens_per_target_pass=ratio(tally.new_tokens, passes) if passes else None,
                       acceptance=ratio(st.get("draft_tokens_accepted", 0), st.get("draft_tokens_evaluated", 0)),
                       ngram_hit_rate=ratio(st.get("ngram_lookup_hits", 0), st.get("ngram_lookup_hits", 0) + st.get("ngram_lookup_misses", 0)),
                       greedy_same_as_reference=agree.get((peer, mode)) if t == 0 else None,
                       stats=st, outputs_round0=tally.outputs)
            rows.append(row)
    return rows, ref


def fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown(rows: list[dict], header: str, ref: str | None) -> str:
    """The table: peer, mode, T, tokens/s, speedup, tokens per target pass, acceptance, agreement."""
    lines = [header, "",
             f"| peer | mode | T | tok/s | speedup vs own AR | new tokens / target pass | acceptance (accepted/evaluated) "
             f"| n-gram hit rate | greedy = {ref or 'reference'} | notes |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "unavailable" in r:
            note = r["unavailable"].replace("|", "\\|")
            lines.append(f"| {r['peer']} | {r['mode']} | {r['T']:g} | n/a | – | – | – | – | – | unavailable: {note} |")
            continue
        lines.append(f"| {r['peer']} | {r['mode']} | {r['T']:g} | {r['tokens_per_s']:.1f} | {fmt(r['speedup'], '.2f')} | "
                     f"{fmt(r['tokens_per_target_pass'], '.2f')} | {fmt(r['acceptance'], '.3f')} | "
                     f"{fmt(r['ngram_hit_rate'], '.3f')} | {r['greedy_same_as_reference'] or '–'} | |")
    return "\n".join(lines) + "\n"


def versions() -> dict[str, str]:
    """Library versions of this (system) python; genai's comes from its worker."""
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "transformers", "onnxruntime", "optimum"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            out[mod] = "missing"
    return out


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="HF checkpoint folder of the target")
    ap.add_argument("--draft", type=Path, required=True, help="HF checkpoint folder of the draft (same tokenizer)")
    ap.add_argument("--bundle", type=Path, default=None, help="specdec bundle exported from --target/--draft (specdec's rows)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request (EOS ignored)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads and ORT intra-op threads")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy")
    ap.add_argument("--only", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    ap.add_argument("--draft-tokens", type=int, default=None,
                    help="pin every speculative peer's proposal width K [default: each peer's own default]")
    ap.add_argument("--ngram-size", type=int, default=3, help="genai n-gram decoding: N (matches the last N-1 tokens)")
    ap.add_argument("--out", type=Path, default=OUT, help="where results.json/results.md go")
    args = ap.parse_args(argv)
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    args.only = sorted(dict.fromkeys(args.only), key=lambda p: PEERS.index(p) if p in PEERS else -1)  # specdec starts last
    if "specdec" in args.only and args.bundle is None:
        args.only.remove("specdec")
    bad = [p for p in args.only if p not in PEERS]
    if bad:
        ap.error(f"--only: unknown peer(s) {bad}; choose from {PEERS}")
    for name in ("prompts", "prompt_tokens", "rounds", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.tokens < 2:
        ap.error("--tokens must be >= 2 (the first token closes the prefill)")
    if args.draft_tokens is not None and not 1 <= args.draft_tokens <= 16:
        ap.error("--draft-tokens must be in [1, 16] (genai's range)")
    args.temps = [float(t) for t in args.temperatures.split(",") if t.strip()]
    return args


def check_context(target: Path, prompt_tokens: int, tokens: int) -> None:
    """Prompt plus new tokens must fit the target's context."""
    ctx = json.loads((target / "config.json").read_text()).get("max_position_embeddings")
    if ctx and prompt_tokens + tokens > ctx:
        raise SystemExit(f"--prompt-tokens + --tokens = {prompt_tokens + tokens} exceeds the target's context ({ctx})")


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--genai-worker":
        return genai_worker(json.loads(sys.argv[2]))
    args = parse_args(argv)
    check_context(args.target, args.prompt_tokens, args.tokens)
    prompts = prompts_for(args.target, args.prompts, args.prompt_tokens)
    log(f"{len(prompts)} prompts of {args.prompt_tokens} tokens")
    peers, unavailable = start_peers(args)
    try:
        tallies = measure(peers, prompts, args.temps, args.tokens, args.rounds, unavailable)
    finally:
        for p in peers:
            p.close()
    order = [(name, mode) for name in args.only for mode in PEER_CLASSES[name].modes]
    rows, ref = summarize(tallies, unavailable, order, args.temps)
    header = (f"target {args.target}, draft {args.draft}: {len(prompts)} held-out prompts of {args.prompt_tokens} tokens "
              f"x {args.rounds} rounds x {args.tokens} new tokens (EOS ignored), {args.threads} threads, interleaved; "
              f"tok/s = decoding after the first new token")
    md = markdown(rows, header, ref)
    settings = {p.name: p.settings for p in peers}
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / "results.json").write_text(json.dumps(
        {"config": config, "versions": versions(), "settings": settings, "prompts": prompts, "rows": rows}, indent=1))
    (args.out / "results.md").write_text(md + "\nsettings: " + json.dumps(settings) + "\n")
    print(md)
    print("settings:", json.dumps(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
