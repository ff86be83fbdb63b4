#!/usr/bin/env python3
"""The venv side of ``specdec bench-peers``' genai, openvino and llamacpp peers (standard library plus
that peer's stack; ``specdec/commands/bench/peers/__init__.py`` says what each mode is and how it is timed)::

    worker.py {optimum,genai,openvino,llamacpp} SPEC_JSON   one reply line per request line, until stdin closes:
        {"cmd": "hello"} -> {"version", "unavailable": {mode: why}, ...}
        {"cmd": "decode", "mode", "temperature", "prompt", "tokens", "seed"} -> {"seconds", "tokens", "new_tokens", "stats", "ids"} or {"error"}
    worker.py gguf LLAMA_CPP_DIR MODEL_DIR OUTFILE {f32,q8_0,q4_0,q4_1}  |  worker.py ov-tokenizer MODEL_DIR OUT_DIR
    worker.py optimum-export MODEL_DIR OUT_DIR  (ORTModelForCausalLM.from_pretrained(export=True), saved)
    worker.py llama-probe FILE.gguf  (a batched eval; exit status -11 where it crashes)
    worker.py llama-quantize SRC.gguf DST.gguf FTYPE  (llama.cpp's own quantizer; FTYPE a llama_ftype number)
    worker.py llama-quality SPEC_JSON  (tools/bench_quality.py's llama.cpp side; see llama_quality)
    worker.py llama-structured SPEC_JSON  (tools/bench_structured.py's llama.cpp side; see llama_structured)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def optimum_session(threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = threads, 3
    return {"session_options": so, "provider": "CPUExecutionProvider"}


def optimum_export(model_dir: str, out_dir: str) -> int:
    from optimum.onnxruntime import ORTModelForCausalLM

    ORTModelForCausalLM.from_pretrained(model_dir, export=True, **optimum_session(1)).save_pretrained(out_dir)
    return 0


def optimum(spec: dict):
    """optimum-onnx's ``ORTModelForCausalLM.generate`` (its own venv: optimum-onnx pins transformers
    below 4.58), timed by a streamer from the first new token to the end, EOS ignored."""
    from importlib.metadata import version

    from optimum.onnxruntime import ORTModelForCausalLM
    from timed_generate import timed_generate  # beside this file

    model = ORTModelForCausalLM.from_pretrained(spec["model"], **optimum_session(int(spec["threads"])))

    def decode(req: dict) -> dict:
        seconds, decoded, new = timed_generate(model, req["prompt"], req["tokens"], req["temperature"], req["seed"], spec["pad"])
        return {"seconds": seconds, "tokens": decoded, "new_tokens": len(new), "stats": {}, "ids": new}

    return {"version": version("optimum-onnx"), "unavailable": {}}, decode


def genai(spec: dict):
    import numpy as np
    import onnxruntime_genai as og

    stat_keys = ("draft_tokens_proposed", "draft_tokens_evaluated", "draft_tokens_accepted", "target_forward_passes",
                 "standard_fallback_steps", "draft_forward_passes", "rounds", "ngram_lookup_hits", "ngram_lookup_misses")
    pair, models, unavailable = Path(spec["pair"]), {}, {}

    def load(folder: Path, blocks: tuple[str, ...]):  # every session's intra-op threads, by a config overlay
        config = og.Config(str(folder))
        config.overlay(json.dumps({"model": {b: {"session_options": {"intra_op_num_threads": spec["threads"]}} for b in blocks}}))
        return og.Model(config)

    try:
        models["autoregressive"] = models["speculative-ngram"] = load(pair / "target", ("decoder",))
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        unavailable.update(dict.fromkeys(("autoregressive", "speculative-ngram"), f"target did not load: {exc}"))
    if not hasattr(og.GeneratorParams, "set_speculative_options"):
        unavailable.update(dict.fromkeys(("speculative-draft", "speculative-ngram"), f"onnxruntime-genai {og.__version__} has no set_speculative_options"))
    else:
        try:
            models["speculative-draft"] = load(pair, ("decoder", "draft"))
        except Exception as exc:  # noqa: BLE001
            unavailable["speculative-draft"] = f"composite speculative model did not load: {exc}"

    def decode(req: dict) -> dict:
        mode, prompt, t = req["mode"], req["prompt"], req["temperature"]
        params = og.GeneratorParams(models[mode])
        total = len(prompt) + req["tokens"]
        search = dict(max_length=total, min_length=total, do_sample=t > 0)
        if t > 0:
            search.update(temperature=t, top_k=0, top_p=1.0, random_seed=req["seed"])  # top_k 0: the full vocabulary
        params.set_search_options(**search)
        speculative = mode != "autoregressive"
        if speculative:
            params.set_speculative_options(max_draft_tokens=spec["k"], **({"ngram_size": spec["ngram_size"]} if mode == "speculative-ngram" else {}))
        gen = og.Generator(models[mode], params)
        gen.append_tokens(np.asarray([prompt], dtype=np.int32))
        gen.generate_next_token()
        t_first = time.perf_counter()
        first = 1 + (int(gen.get_speculative_stats().get("tokens_buffered", 0)) if speculative else 0)
        while not gen.is_done():
            gen.generate_next_token()
        t_end = time.perf_counter()
        ids = gen.get_sequence(0)[len(prompt):].tolist()
        got = gen.get_speculative_stats() if speculative else None
        stats = {key: float(got.get(key, 0)) for key in stat_keys} if got is not None else {}
        return {"seconds": t_end - t_first, "tokens": len(ids) - first, "new_tokens": len(ids), "stats": stats, "ids": ids}

    return {"version": og.__version__, "unavailable": unavailable}, decode


# openvino.genai issue 4190: draft_model with sampling fails this check for some seeds (the sampler's
# rejection path, which also corrupts output when it does not fail).
KNOWN_SAMPLING_BUG = "content_length <= prompt_ids.size()"


def openvino(spec: dict):
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    # f32 compute: the CPU plugin's default on a CPU with bf16 units (AMX) is bf16, another model than the float32 weights
    props = {"INFERENCE_NUM_THREADS": int(spec["threads"]), "INFERENCE_PRECISION_HINT": "f32"}
    target, draft = spec["target"], spec["draft"]
    makers = {"autoregressive": lambda: og.LLMPipeline(target, "CPU", **props),
              "speculative-draft": lambda: og.LLMPipeline(target, "CPU", draft_model=og.draft_model(draft, "CPU", **props), **props),
              "speculative-lookup": lambda: og.LLMPipeline(target, "CPU", prompt_lookup=True, **props),
              **{f"autoregressive-{p}": (lambda f=f: og.LLMPipeline(f, "CPU", **props)) for p, f in spec["quantized"].items()}}
    pipes, unavailable = {}, dict(spec.get("unavailable", {}))
    for mode, make in makers.items():
        try:
            pipes[mode] = make()
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            unavailable[mode] = f"LLMPipeline did not load: {first_line(exc)}"

    class Clock(og.StreamerBase):  # write() is called once per generation step with that step's tokens
        def __init__(self) -> None:
            super().__init__()
            self.writes, self.t_end = [], None

        def write(self, token):
            self.writes.append((time.perf_counter(), 1 if isinstance(token, int) else len(token)))
            return og.StreamingStatus.RUNNING

        def end(self) -> None:
            self.t_end = time.perf_counter()

    def decode(req: dict) -> dict:
        mode, tokens, t = req["mode"], int(req["tokens"]), float(req["temperature"])
        gc = og.GenerationConfig()
        # No min_new_tokens: it zeroes EOS's probability (another distribution than the other peers')
        # and, in 2026.4 with a draft model and sampling, trips an internal check.
        gc.max_new_tokens, gc.ignore_eos = tokens, True
        if t > 0:
            gc.do_sample, gc.temperature, gc.top_p, gc.min_p, gc.rng_seed = True, t, 1.0, 0.0, int(req["seed"])
        if not mode.startswith("autoregressive"):
            gc.num_assistant_tokens = int(spec["k"])
        if mode == "speculative-lookup":
            gc.max_ngram_size = int(spec["ngram_size"])
        clock = Clock()
        try:
            res = pipes[mode].generate(ov.Tensor(np.asarray([req["prompt"]], dtype=np.int64)), gc, clock)
        except RuntimeError as exc:
            pipes[mode] = makers[mode]()  # once failed, the draft pipeline stops drafting in greedy requests too
            if KNOWN_SAMPLING_BUG in str(exc):
                raise RuntimeError(f"draft_model with sampling failed its check '{KNOWN_SAMPLING_BUG}...' at seed {req['seed']} "
                                   "(known upstream bug, openvino.genai issue 4190)") from exc
            raise
        out = [int(x) for x in res.tokens[0]]
        if len(out) != tokens or not clock.writes or clock.t_end is None:
            raise RuntimeError(f"asked for {tokens} new tokens, got {len(out)} in {len(clock.writes)} streamer writes")
        pm, ext = res.perf_metrics, res.extended_perf_metrics  # perf_metrics agree with the clock to ~1%: kept, not used
        stats = {"target_passes": float(len(clock.writes)), "pm_ttft_ms": pm.get_ttft().mean, "pm_generate_ms": pm.get_generate_duration().mean}
        if mode == "speculative-draft" and ext is not None and hasattr(ext, "get_num_accepted_tokens"):
            stats.update(draft_tokens_accepted=float(ext.get_num_accepted_tokens()), draft_tokens_evaluated=float(ext.get_num_draft_tokens()))
        return {"seconds": clock.t_end - clock.writes[0][0], "tokens": tokens - clock.writes[0][1], "new_tokens": tokens, "stats": stats, "ids": out}

    return {"version": og.__version__, "openvino": ov.__version__, "unavailable": unavailable}, decode


NO_DRAFT_MODEL = ("llama-cpp-python has no draft-model drafter: Llama(draft_model=) takes a LlamaDraftModel and the only one it ships "
                  "is LlamaPromptLookupDecoding (llama.cpp's own draft-model speculation is not bound)")


def llamacpp(spec: dict):
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    class CountingLookup(LlamaPromptLookupDecoding):
        proposed = 0

        def __call__(self, input_ids, /, **kwargs):
            out = super().__call__(input_ids, **kwargs)
            self.proposed += len(out)
            return out

    class Runner:
        """One ``Llama`` (with the lookup drafter or without) whose ``eval`` calls are counted."""

        def __init__(self, path: str, lookup: bool, batch: int) -> None:
            self.drafter = CountingLookup(max_ngram_size=int(spec["ngram_size"]), num_pred_tokens=int(spec["k"])) if lookup else None
            n = int(spec["threads"])
            self.llm = llama_cpp.Llama(model_path=path, n_ctx=int(spec["n_ctx"]), n_batch=batch, n_threads=n, n_threads_batch=n, draft_model=self.drafter,
                                       verbose=False)  # fmt: skip
            self.passes, evaluate = 0, self.llm.eval

            def counted(tokens) -> None:  # an instance attribute: generate's self.eval finds it
                self.passes += 1
                evaluate(tokens)

            self.llm.eval = counted

        def decode(self, req: dict) -> dict:
            t, tokens = float(req["temperature"]), int(req["tokens"])
            sampling = {"temp": 0.0} if t == 0 else {"temp": t, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0}
            self.llm.reset()  # no prompt cache carried between requests
            self.llm.set_seed(int(req["seed"]))
            self.passes, proposed0, out, t_first = 0, self.drafter.proposed if self.drafter else 0, [], 0.0
            gen = self.llm.generate(req["prompt"], repeat_penalty=1.0, **sampling)
            for tok in gen:  # generate never stops on EOS by itself: take exactly `tokens`
                t_first = t_first or time.perf_counter()
                out.append(int(tok))
                if len(out) == tokens:
                    break
            t_end = time.perf_counter()
            gen.close()
            stats = {"target_passes": float(self.passes)}
            if self.drafter is not None:  # each pass yields its accepted proposals plus one token
                stats.update(draft_tokens_evaluated=float(self.drafter.proposed - proposed0), draft_tokens_accepted=float(len(out) - self.passes))
            return {"seconds": t_end - t_first, "tokens": len(out) - 1, "new_tokens": len(out), "stats": stats, "ids": out}

    runners, unavailable = {}, {"speculative-draft": NO_DRAFT_MODEL, **spec.get("unavailable", {})}
    for precision, path in spec["gguf"].items():
        for base in ("autoregressive", "speculative-lookup"):
            mode = base if precision == "f32" else f"{base}-{precision}"
            if mode in unavailable:
                continue
            try:  # n_batch 1 where a batched eval crashed the probe: the prompt a token a call (prefill is not timed)
                runners[mode] = Runner(path, lookup=base != "autoregressive", batch=1 if precision in spec.get("unbatched", ()) else int(spec["n_ctx"]))
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                unavailable[mode] = f"Llama({path}) did not load: {first_line(exc)}"
    hello = {"version": llama_cpp.__version__, "unavailable": unavailable, "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}
    return hello, lambda req: runners[req["mode"]].decode(req)


def llama_probe(path: str) -> int:
    """Evaluate 4 tokens in one batch (a verify call's shape): a process that crashes here would take
    the worker with it (llama-cpp-python 0.3.36's quantized batched eval segfaults on an AMX CPU)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=1, n_threads_batch=1, verbose=False)
    llm.eval([1, 2, 3, 4])
    return 0


def gguf(tree: str, model_dir: str, outfile: str, outtype: str) -> int:
    """``model_dir`` to GGUF by llama.cpp's own ``convert_hf_to_gguf.py`` (q4_0, q4_1: f32, then
    libllama's ``llama_model_quantize``). The converter refuses a BPE tokenizer whose pre-tokenizer hash it has
    never seen (the demo pair's); plain byte-level BPE with the GPT-2 regex is llama.cpp's "gpt-2"."""
    if outtype in ("q4_0", "q4_1"):
        f32 = outfile + ".f32.tmp"
        gguf(tree, model_dir, f32, "f32")
        import ctypes

        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0 if outtype == "q4_0" else llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1
        params.nthread = 2
        if llama_cpp.llama_model_quantize(f32.encode(), outfile.encode(), ctypes.byref(params)) != 0:
            sys.exit(f"llama_model_quantize {f32} -> {outfile} ({outtype}) failed")
        os.unlink(f32)
        return 0
    sys.path[:0] = [str(Path(tree) / "gguf-py"), tree]  # the converter's own gguf, not PyPI's
    import conversion.base
    import convert_hf_to_gguf

    text_model = conversion.base.TextModel
    original = text_model.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            path = Path(model_dir) / "tokenizer.json"
            tok = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
            pre, norm = tok.get("pre_tokenizer") or {}, tok.get("normalizer") or {}  # an empty normalizer Sequence does nothing
            if not (tok.get("model", {}).get("type") == "BPE" and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
                    and (not norm or (norm.get("type") == "Sequence" and not norm.get("normalizers")))):
                raise
            print(f"[worker gguf] {model_dir}: unknown BPE pre-tokenizer hash; byte-level BPE with the GPT-2 regex: 'gpt-2'", file=sys.stderr)
            return "gpt-2"

    text_model.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(Path(tree) / "convert_hf_to_gguf.py"), model_dir, "--outfile", outfile, "--outtype", outtype]
    convert_hf_to_gguf.main()
    return 0


def ov_tokenizer(src: str, out: str) -> int:
    """``src``'s tokenizer with a plain ByteLevel decoder, converted by openvino-tokenizers (2026.4 cannot convert
    the SentencePiece-style decoder chain transformers 5 rebuilds for SmolLM2's GGUF; its vocabulary is GPT-2
    byte-level). Only ids go in and out: the detokenizer must exist for LLMPipeline to load, and never runs."""
    import shutil
    import tempfile

    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(src) / f).is_file():
                shutil.copy(Path(src) / f, tmp)
        d = json.loads((Path(tmp) / "tokenizer.json").read_text())
        d["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
        d["model"]["byte_fallback"] = False
        (Path(tmp) / "tokenizer.json").write_text(json.dumps(d, ensure_ascii=False))
        tok, detok = convert_tokenizer(AutoTokenizer.from_pretrained(tmp), with_detokenizer=True)
    ov.save_model(tok, str(Path(out) / "openvino_tokenizer.xml"))
    ov.save_model(detok, str(Path(out) / "openvino_detokenizer.xml"))
    return 0


def llama_quantize(src: str, dst: str, ftype: str) -> int:
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.allow_requantize, p.nthread = int(ftype), True, 2
    return llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p)


def llama_quality(spec: dict) -> int:
    """For one GGUF: ``out/logits.npy`` (float32 [sum of window lengths, V], each of ``windows``
    evaluated from an empty context, as ``specdec.commands.bench.quality`` does for a bundle) and
    ``out/greedy.json`` ({"tokens", "tokens_per_second"}: the argmax after each single-token
    ``eval`` of ``steps`` tokens past each of ``prompts``, no sampler, EOS ignored; tokens/s counts
    decoding after the prefill, one token a call, as specdec's autoregressive figure does)."""
    import numpy as np
    from llama_cpp import Llama

    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    n_ctx = max([len(w) for w in spec["windows"]] + [len(p) + spec["steps"] for p in spec["prompts"]]) + 8
    batch = int(spec.get("batch") or n_ctx)  # 1: a token per eval (llama-cpp-python 0.3.36's batched Q8_0 eval crashed on an AMX CPU)
    common = dict(model_path=spec["gguf"], n_ctx=n_ctx, n_batch=batch, n_threads=spec["threads"], n_threads_batch=spec["threads"], verbose=False)
    llm = Llama(logits_all=True, **common)
    vocab = llm.n_vocab()
    logits = np.lib.format.open_memmap(out / "logits.npy", mode="w+", dtype=np.float32, shape=(sum(map(len, spec["windows"])), vocab))
    start = 0
    for w in spec["windows"]:
        llm.reset()
        llm.eval(w)
        logits[start : start + len(w)] = llm.scores[: len(w)]
        start += len(w)
    logits.flush()
    del llm
    llm = Llama(logits_all=False, **common)  # without logits_all the binding keeps no scores: read the last row
    last = lambda: np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))  # noqa: E731
    tokens, seconds, decoded = [], 0.0, 0
    for p in spec["prompts"]:
        llm.reset()
        llm.eval(p)
        got = [int(np.argmax(last()))]
        t0 = time.perf_counter()
        for _ in range(spec["steps"] - 1):
            llm.eval([got[-1]])
            got.append(int(np.argmax(last())))
        seconds, decoded = seconds + time.perf_counter() - t0, decoded + len(got) - 1
        tokens.append(got)
    (out / "greedy.json").write_text(json.dumps({"tokens": tokens, "tokens_per_second": decoded / seconds}))
    return 0


def llama_structured(spec: dict) -> int:
    """tools/bench_structured.py's llama.cpp side: each of ``prompts`` (token ids) decoded greedily
    up to ``tokens`` new tokens, free and held to its schema (``LlamaGrammar.from_json_schema``,
    llama.cpp's grammar sampler), interleaved over ``rounds``; ``out`` gets one record per run:
    {"i", "mode", "new_tokens", "decode_seconds" (wall time less the prompt's eval), "text", "finish"}."""
    import llama_cpp
    from llama_cpp import Llama, LlamaGrammar

    n_ctx = max(len(p) for p in spec["prompts"]) + spec["tokens"] + 8
    llm = Llama(model_path=spec["gguf"], n_ctx=n_ctx, n_batch=n_ctx, n_threads=spec["threads"], n_threads_batch=spec["threads"], verbose=False)
    grammars = [LlamaGrammar.from_json_schema(json.dumps(s), verbose=False) for s in spec["schemas"]]
    runs, items = [], [(i, mode) for i in range(len(spec["prompts"])) for mode in ("free", "json")]
    for r in range(spec["rounds"]):
        for i, mode in items if r % 2 == 0 else items[::-1]:
            llm.reset()
            llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
            t0 = time.perf_counter()
            out = llm.create_completion(prompt=spec["prompts"][i], max_tokens=spec["tokens"], temperature=0.0,
                                        grammar=grammars[i] if mode == "json" else None)  # fmt: skip
            wall = time.perf_counter() - t0
            perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
            choice = out["choices"][0]
            runs.append({"i": i, "mode": mode, "new_tokens": out["usage"]["completion_tokens"], "decode_seconds": wall - perf.t_p_eval_ms / 1000,
                         "text": choice["text"], "finish": choice["finish_reason"]})  # fmt: skip
    Path(spec["out"]).write_text(json.dumps({"version": llama_cpp.__version__, "runs": runs}))
    return 0


def serve(kind: str, spec: dict) -> int:
    reply = os.fdopen(os.dup(1), "w", buffering=1)  # the real stdout; fd 1 becomes stderr, so library prints stay out of the replies
    os.dup2(2, 1)
    hello, decode = {"optimum": optimum, "genai": genai, "openvino": openvino, "llamacpp": llamacpp}[kind](spec)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            out = hello if req["cmd"] == "hello" else decode(req)
        except Exception as exc:  # noqa: BLE001 - the client marks the mode unavailable
            out = {"error": first_line(exc)}
        reply.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    if len(a) == 2 and a[0] in ("optimum", "genai", "openvino", "llamacpp"):
        sys.exit(serve(a[0], json.loads(a[1])))
    if len(a) == 5 and a[0] == "gguf" and a[4] in ("f32", "q8_0", "q4_0", "q4_1"):
        sys.exit(gguf(*a[1:]))
    if len(a) == 2 and a[0] == "llama-probe":
        sys.exit(llama_probe(a[1]))
    if len(a) == 3 and a[0] == "optimum-export":
        sys.exit(optimum_export(*a[1:]))
    if len(a) == 3 and a[0] == "ov-tokenizer":
        sys.exit(ov_tokenizer(*a[1:]))
    if len(a) == 4 and a[0] == "llama-quantize":
        sys.exit(llama_quantize(*a[1:]))
    if len(a) == 2 and a[0] == "llama-quality":
        sys.exit(llama_quality(json.loads(a[1])))
    if len(a) == 2 and a[0] == "llama-structured":
        sys.exit(llama_structured(json.loads(a[1])))
    sys.exit(__doc__)
