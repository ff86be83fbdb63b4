"""The peers in private venvs (onnxruntime-genai, OpenVINO GenAI, llama.cpp): the venvs (one place for
their pins), the model conversions made with them, and the client of ``workers/worker.py``."""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from specdec.atomic import build_atomic
from specdec.commands.bench.peers.base import ModeUnavailable, Options, Peer, Sample, checkpoint_key, log

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class SetupError(RuntimeError):
    """A venv or a conversion could not be made; the message names the step and its log."""


@dataclass(frozen=True)
class VenvSpec:
    """Folder name, pins, an import that must work afterwards, pip's extra environment, dependencies to uninstall, cost."""

    name: str
    packages: tuple[str, ...]
    probe: str
    build_env: dict[str, str] = field(default_factory=dict)
    remove: tuple[str, ...] = ()
    note: str = ""

    def stamp(self) -> str:
        return "\n".join([*self.packages, *(f"{k}={v}" for k, v in sorted(self.build_env.items())), *(f"-{r}" for r in self.remove)]) + "\n"


# Verified together (2026-11, Python 3.11, CPU).
# optimum-onnx 0.1.0 requires transformers < 4.58: its own venv keeps that pin out of specdec's extras.
OPTIMUM = VenvSpec("optimum-venv", ("optimum-onnx==0.1.0", "transformers==4.57.6", "torch==2.13.0", "onnxruntime==1.32.0", "onnx==1.23.2"),
                   "import optimum.onnxruntime", note="CPU torch; ~1 min")
GENAI = VenvSpec("genai-venv", ("onnxruntime-genai==0.18.0", "transformers==5.23.0", "torch==2.13.0", "onnx==1.23.2", "onnx_ir==1.1.0"),
                 "import onnxruntime_genai.models.builder", note="CPU torch; ~1 min")  # the model builder needs transformers 5
# optimum-intel pulls in torchvision, whose PyPI wheel is built against CUDA torch and breaks
# transformers' imports next to CPU torch; exporting text models does not need it.
OPENVINO = VenvSpec("openvino-venv", ("openvino==2026.4.1", "openvino-genai==2026.4.1.0", "openvino-tokenizers==2026.4.1.0",
                                      "optimum-intel[openvino]==2.2.0", "optimum==2.3.0", "transformers==5.5.4", "nncf==3.4.0", "torch==2.13.0"),
                    "import openvino_genai, openvino_tokenizers, optimum.exporters.openvino", remove=("torchvision",), note="~1-2 min")
# llama-cpp-python from source (gcc 12, cmake 3.25); the rest is convert_hf_to_gguf.py's: transformers
# as its requirements pin it, sentencepiece (its Llama vocabulary path imports it), gguf's dependencies.
LLAMACPP_VERSION = "0.3.36"
LLAMACPP = VenvSpec("llamacpp-venv", (f"llama-cpp-python=={LLAMACPP_VERSION}", "gguf==0.19.0", "sentencepiece==0.2.3", "torch==2.13.0", "transformers==4.57.6"),
                    "import llama_cpp, llama_cpp.llama_speculative, gguf, sentencepiece, torch, transformers",
                    build_env={"CMAKE_ARGS": "-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF "
                                             "-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF", "CMAKE_BUILD_PARALLEL_LEVEL": "2"},
                    note="builds llama.cpp from source: ~12 min on 2 cores")


def default_work() -> Path:
    """``$SPECDEC_CACHE/peers``, else ``~/.cache/specdec/peers`` (the demo bundles' cache root)."""
    from specdec.commands.demo import cache_root

    return cache_root() / "peers"


def run_logged(cmd: list, log_file: Path, what: str, env: dict[str, str] | None = None, timeout_s: float = 3600) -> None:
    """``cmd`` at the lowest CPU priority, its output appended to ``log_file``; SetupError naming
    ``what`` and the log's last lines when it fails or outlives ``timeout_s``."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("a") as out:
        out.write(f"\n$ {' '.join(map(str, cmd))}\n")
        out.flush()
        try:
            proc = subprocess.run(["nice", "-n", "19", *map(str, cmd)], stdout=out, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, **(env or {})), timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise SetupError(f"{what} took over {timeout_s:.0f} s; stopped (log {log_file})") from exc
    if proc.returncode != 0:
        text = log_file.read_text(errors="replace")
        lines = text[text.rfind("\n$ ") + 1:].strip().splitlines()[1:]  # this command's output (the log holds earlier ones too)
        errors = [ln.strip() for ln in lines if re.match(r"\s*[\w.]*(Error|Exception)\b", ln)]  # a Python exception's last line
        tail = errors[-1] if errors else " / ".join(lines[-3:])
        raise SetupError(f"{what} failed (rc={proc.returncode}; log {log_file}): {tail[-400:]}")


def ensure_venv(spec: VenvSpec, work: Path, setup: bool = True) -> Path:
    """The python of ``work/spec.name``, (re)installed by pip unless its stamp lists exactly the spec's
    pins and build environment (ModeUnavailable if it must be and ``setup`` is off; SetupError if it fails)."""
    folder = work / spec.name
    python, stamp = folder / "bin" / "python", folder / ".specdec-peer-ok"
    if python.exists() and stamp.is_file() and stamp.read_text() == spec.stamp():
        return python
    if not setup:
        raise ModeUnavailable(f"no ready venv at {folder} (--no-setup given; run without it to create it)")
    log_file, t0 = work / f"{spec.name}.install.log", time.perf_counter()
    log(f"{spec.name}: venv {folder}, pip install {' '.join(spec.packages)}{f' ({spec.note})' if spec.note else ''}; log {log_file}")
    if not python.exists():
        run_logged([sys.executable, "-m", "venv", folder], log_file, f"creating venv {folder}")
    run_logged([python, "-m", "pip", "install", "--disable-pip-version-check", *spec.packages], log_file, f"pip install into {folder}", env=spec.build_env)
    if spec.remove:
        run_logged([python, "-m", "pip", "uninstall", "-y", *spec.remove], log_file, f"pip uninstall in {folder}")
    run_logged([python, "-c", spec.probe], log_file, f"import check in {folder}")
    stamp.write_text(spec.stamp())
    log(f"{spec.name}: ready in {time.perf_counter() - t0:.0f}s")
    return python


def build_once(out: Path, build: Callable[[Path], None], what: str, setup: bool = True) -> Path:
    """``out`` as is when it exists, else made by ``build(tmp)`` in a sibling folder renamed into
    place on success (so an existing ``out`` is complete); ModeUnavailable when ``setup`` is off."""
    if out.is_dir():
        return out
    if not setup:
        raise ModeUnavailable(f"no {what} at {out} (--no-setup given; run without it to convert)")
    t0 = time.perf_counter()
    log(f"building {what} -> {out}")
    build_atomic(out, build)
    log(f"built {what} in {time.perf_counter() - t0:.0f}s")
    return out


def gguf_checkpoint(gguf: Path, work: Path, setup: bool = True) -> Path:
    """A GGUF file as a float32 Hugging Face checkpoint folder under ``work/checkpoints`` (made once,
    keyed by the file's path, size and mtime), as specdec-export dequantizes it: every peer then
    runs the same weights (llama.cpp's F32 file is converted back from it)."""
    from specdec.errors import ModelError
    from specdec.export.gguf_file import check_header, load_gguf_model, one_parse
    from specdec.export.tokenizer_files import save_tokenizer

    if gguf.suffix != ".gguf":
        raise ModelError(f"--target {gguf}: a file must be a .gguf; else give a Hugging Face checkpoint folder")
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        with one_parse():
            check_header(gguf)
            load_gguf_model(AutoModelForCausalLM, gguf).save_pretrained(tmp, safe_serialization=True)
            save_tokenizer(AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name), tmp)

    return build_once(work / "checkpoints" / f"{gguf.stem}-{key}", build, f"float32 checkpoint of {gguf.name}", setup)


WORKER = Path(__file__).with_name("workers") / "worker.py"
REPLY_TIMEOUT_S = 900.0  # the longest a reply may take: loading models, or one request


class WorkerPeer(Peer):
    """A peer whose library runs in ``worker.py NAME SPEC`` under its venv's python, one JSON line per
    request and reply; ``prepare(options, python, k)`` converts the models: (worker spec, settings)."""

    venv: ClassVar[VenvSpec]
    default_k: ClassVar[int]

    def __init__(self, o: Options) -> None:
        python = ensure_venv(self.venv, o.work, o.setup)
        k = self.default_k if o.draft_tokens is None else o.draft_tokens
        spec, settings = self.prepare(o, python, k)
        spec.update(threads=o.threads, k=k, ngram_size=o.ngram_size)
        # OpenMP (llama.cpp's ggml) as a user gets it: OMP_WAIT_POLICY unset, so its threads spin briefly between ops and
        # then sleep. PASSIVE (sleep at once) made llama.cpp ~2x slower on SmolLM2-135M (docs/bench/real-model/peers-chat-first).
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        self.proc = subprocess.Popen([str(python), str(WORKER), self.name, json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1, env=env)
        hello = self.ask({"cmd": "hello"})
        self.unavailable: dict[str, str] = hello.pop("unavailable")
        self.settings = {**hello, **settings}

    def ask(self, request: dict) -> dict:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            if not select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)[0]:  # one line per request: no read-ahead
                self.proc.kill()
                raise RuntimeError(f"{self.name} worker sent no reply in {REPLY_TIMEOUT_S:.0f} s to {request['cmd']}; killed it")
            if line := self.proc.stdout.readline():
                return json.loads(line)
        raise RuntimeError(f"{self.name} worker exited (rc={self.proc.wait()}); its stderr says why")

    def decode(self, mode: str, temperature: float, prompt: list[int], tokens: int, seed: int) -> Sample:
        if mode in self.unavailable:
            raise ModeUnavailable(self.unavailable[mode])
        reply = self.ask({"cmd": "decode", "mode": mode, "temperature": temperature, "prompt": prompt, "tokens": tokens, "seed": seed})
        if "error" in reply:
            raise ModeUnavailable(reply["error"])
        return Sample(reply["seconds"], reply["tokens"], reply["new_tokens"], reply["stats"], reply["ids"])

    def close(self) -> None:
        self.proc.stdin.close()  # the worker ends at end of input
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class OptimumPeer(WorkerPeer):
    name, venv, default_k = "optimum", OPTIMUM, 0
    modes = ("autoregressive",)

    def prepare(self, o: Options, python: Path, k: int) -> tuple[dict, dict]:
        """The target exported once by optimum-onnx (``ORTModelForCausalLM``, ``export=True``)."""
        cache = build_once(o.work / "optimum" / f"{o.target.resolve().name}-{checkpoint_key(o.target)}",
                           lambda tmp: run_logged([python, WORKER, "optimum-export", o.target.resolve(), tmp], o.work / "optimum" / "export.log",
                                                  f"optimum-onnx export of {o.target}", env=OFFLINE),
                           f"optimum-onnx export of {o.target}", o.setup)
        from specdec.commands.bench.peers.local import pad_id

        return {"model": str(cache), "pad": pad_id(o.target)}, {"cache": str(cache), "ort_intra_op_threads": o.threads}


class GenaiPeer(WorkerPeer):
    name, venv, default_k = "genai", GENAI, 4
    draft_modes = ("speculative-draft",)
    modes = ("autoregressive", "speculative-draft", "speculative-ngram")

    def prepare(self, o: Options, python: Path, k: int) -> tuple[dict, dict]:
        """Model builder graphs (fp32, CPU EP) in ``pair/target`` and ``pair/draft`` and a composite
        ``pair/genai_config.json`` (genai 0.18 rejects ``..`` in model filenames, hence below it)."""
        sources = (("target", o.target),) + ((("draft", o.draft),) if o.draft else ())
        pair = o.work / "genai" / "-".join([*(src.resolve().name for _, src in sources), checkpoint_key(*(src for _, src in sources))])
        for name, src in sources:
            build_once(pair / name, lambda tmp, src=src: run_logged(
                [python, "-m", "onnxruntime_genai.models.builder", "-i", src.resolve(), "-o", tmp.resolve(), "-p", "fp32", "-e", "cpu",
                 "-c", (pair / "builder-cache").resolve()], o.work / "genai" / "build.log", f"model builder on {src}", env=OFFLINE),
                f"onnxruntime-genai graphs of {src}", o.setup)
        if o.draft is not None:  # a composite speculative model (without a draft, no pair config: the worker lists that mode unavailable)
            cfg = json.loads((pair / "target" / "genai_config.json").read_text())
            drafted = json.loads((pair / "draft" / "genai_config.json").read_text())["model"]
            if drafted["vocab_size"] != cfg["model"]["vocab_size"]:
                raise ValueError(f"target vocab {cfg['model']['vocab_size']} != draft vocab {drafted['vocab_size']}")
            cfg["model"]["type"] = "speculative"
            cfg["model"]["decoder"]["filename"] = "target/" + cfg["model"]["decoder"]["filename"]
            cfg["model"]["draft"] = dict(drafted["decoder"], filename="draft/" + drafted["decoder"]["filename"])
            cfg["speculative"] = {"max_draft_tokens": k}
            (pair / "genai_config.json").write_text(json.dumps(cfg, indent=2))
        return {"pair": str(pair)}, {"max_draft_tokens": k, "ngram_size": o.ngram_size, "ort_intra_op_threads": o.threads, "models": str(pair)}


class OpenVINOPeer(WorkerPeer):
    name, venv, default_k = "openvino", OPENVINO, 4  # num_assistant_tokens has no default and must be set: genai's
    draft_modes = ("speculative-draft",)
    modes = ("autoregressive", "speculative-draft", "speculative-lookup", "autoregressive-int8", "autoregressive-int4")

    def prepare(self, o: Options, python: Path, k: int) -> tuple[dict, dict]:
        target, quantized, failed = self.export(o, python, o.target, "fp32"), {}, {}
        for p in ("int8", "int4"):
            try:
                quantized[p] = str(self.export(o, python, o.target, p))
            except SetupError as exc:  # that width's mode only (optimum-intel's int4 group size must divide every row)
                failed[f"autoregressive-{p}"] = str(exc).splitlines()[0]
        draft = str(self.export(o, python, o.draft, "fp32")) if o.draft else None
        spec = {"target": str(target), "draft": draft, "quantized": quantized, "unavailable": failed}
        return spec, {"num_assistant_tokens": k, "max_ngram_size": o.ngram_size, "inference_num_threads": o.threads,
                      "weights": "fp32 (uncompressed); -int8/-int4 modes: optimum-cli --weight-format int8/int4 (defaults)",
                      "inference_precision_hint": "f32",
                      "input": "token ids (ov.Tensor)", "timing": "streamer write timestamps", "target": spec["target"], "draft": spec["draft"]}

    @staticmethod
    def export(o: Options, python: Path, src: Path, weights: str) -> Path:
        """``src`` as OpenVINO IR by optimum-cli, with its tokenizer converted (by the worker with a
        plain byte-level decoder when optimum-cli cannot: the pipeline only needs the files)."""
        log_file = o.work / "openvino" / "export.log"

        def build(tmp: Path) -> None:
            run_logged([python.parent / "optimum-cli", "export", "openvino", "--model", src.resolve(), "--task", "text-generation-with-past",
                        "--weight-format", weights, tmp], log_file, f"optimum-cli export openvino of {src}", env=OFFLINE)
            if (tmp / "openvino_model.xml").is_file() and not (tmp / "openvino_detokenizer.xml").is_file():
                run_logged([python, WORKER, "ov-tokenizer", src.resolve(), tmp], log_file, f"tokenizer conversion of {src} (byte-level decoder)")
            missing = [f for f in ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml") if not (tmp / f).is_file()]
            if missing:
                raise SetupError(f"optimum-cli export of {src} wrote no {missing}: LLMPipeline needs them (is tokenizer.json there?)")

        suffix = "" if weights == "fp32" else f"-{weights}"
        return build_once(o.work / "openvino" / f"{src.resolve().name}-{checkpoint_key(src)}{suffix}", build, f"OpenVINO IR ({weights}) of {src}", o.setup)


class LlamaCppPeer(WorkerPeer):
    name, venv, default_k = "llamacpp", LLAMACPP, 10  # LlamaPromptLookupDecoding's own num_pred_tokens
    modes = ("autoregressive", "speculative-lookup", "speculative-draft",
             "autoregressive-q8_0", "speculative-lookup-q8_0", "autoregressive-q4_0", "speculative-lookup-q4_0",
             "autoregressive-q4_1", "speculative-lookup-q4_1")
    PRECISIONS = ("f32", "q8_0", "q4_0", "q4_1")  # q4_1: a Q4_1 GGUF's own blocks back (llama.cpp's recipe is idempotent on them)

    def prepare(self, o: Options, python: Path, k: int) -> tuple[dict, dict]:
        """GGUF files of the target by the converter of the llama.cpp tree the binding was built from
        (``vendor/llama.cpp`` of its sdist, fetched once with ``pip download``)."""
        folder = o.work / "llamacpp"

        def fetch(tmp: Path) -> None:
            run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={LLAMACPP_VERSION}",
                        "-d", tmp], folder / "source.log", f"pip download llama-cpp-python=={LLAMACPP_VERSION} (sdist)")
            sdist = tmp / f"llama_cpp_python-{LLAMACPP_VERSION}.tar.gz"
            if not sdist.is_file():
                raise SetupError(f"pip download wrote no {sdist.name} into {tmp}")
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            sdist.unlink()

        def converter(p: str) -> Callable[[Path], None]:
            def convert(tmp: Path) -> None:
                src = build_once(folder / f"llama-cpp-python-{LLAMACPP_VERSION}", fetch, f"llama-cpp-python {LLAMACPP_VERSION} sources", o.setup)
                tree = src / f"llama_cpp_python-{LLAMACPP_VERSION}" / "vendor" / "llama.cpp"
                if not (tree / "convert_hf_to_gguf.py").is_file():
                    raise SetupError(f"{tree} has no convert_hf_to_gguf.py: the sdist's layout changed")
                run_logged([python, WORKER, "gguf", tree, o.target.resolve(), tmp / f"model-{p}.gguf", p], folder / "convert.log",
                           f"convert_hf_to_gguf {o.target} -> {p}", env=OFFLINE)

            return convert

        key = f"{o.target.resolve().name}-{checkpoint_key(o.target)}"
        outs = {p: build_once(folder / key / p, converter(p), f"{p} GGUF of {o.target}", o.setup) for p in self.PRECISIONS}
        spec = {"gguf": {p: str(outs[p] / f"model-{p}.gguf") for p in self.PRECISIONS}, "n_ctx": o.n_ctx, "unbatched": [], "unavailable": {}}
        for p, path in spec["gguf"].items():
            probe = subprocess.run([str(python), str(WORKER), "llama-probe", path], capture_output=True, text=True, timeout=300)
            if probe.returncode != 0:  # its autoregressive mode evaluates one token a call; speculation needs batches
                spec["unbatched"].append(p)
                mode = "speculative-lookup" + ("" if p == "f32" else f"-{p}")
                spec["unavailable"][mode] = (f"a batched eval of {Path(path).name} ends the process (rc={probe.returncode}) in llama-cpp-python "
                                             f"{LLAMACPP_VERSION} on this CPU (seen on a CPU with AMX); its autoregressive mode ran with n_batch = 1")
                log(f"llamacpp: {mode} unavailable: {spec['unavailable'][mode]}")
        return spec, {"num_pred_tokens": k, "max_ngram_size": o.ngram_size, "n_threads": o.threads, "n_ctx": o.n_ctx, "gguf": spec["gguf"],
                      "n_batch_1": spec["unbatched"],
                      "input": "token ids", "timing": "generate's first to last token"}
