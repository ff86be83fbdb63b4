"""llama.cpp through llama-cpp-python, driven through ``tools/llamacpp_worker.py`` running in its
private venv (``.bench/llamacpp-venv``, the binding built from source for this CPU); the target
converted to GGUF (F32 and Q8_0) by llama.cpp's ``convert_hf_to_gguf.py``, and Q4_0 from the F32
file by the library's ``llama_model_quantize``."""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path

from peers.base import OUT, checkpoint_key
from peers.venv import SetupError, VenvSpec, build_once, ensure_venv, run_logged
from peers.worker import Worker, WorkerPeer

VERSION = "0.3.36"
# Verified together (2026-11, Python 3.11, gcc 12, cmake 3.25, 2 cores: the build takes ~12 min
# at nice 19). The rest is for convert_hf_to_gguf.py: transformers as its requirements file pins
# it, sentencepiece because its Llama vocabulary path imports it before trying tokenizer.json,
# gguf for gguf-py's dependencies (the converter imports the gguf-py of its own source tree).
VENV = VenvSpec(
    name="llamacpp-venv",
    packages=(f"llama-cpp-python=={VERSION}", "gguf==0.19.0", "sentencepiece==0.2.3", "torch==2.13.0",
              "transformers==4.57.6"),
    probe="import llama_cpp, llama_cpp.llama_speculative, gguf, sentencepiece, torch, transformers",
    build_env={"CMAKE_ARGS": "-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF "
                             "-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF",
               "CMAKE_BUILD_PARALLEL_LEVEL": "2"},
    note="builds llama.cpp from source: ~12 min on 2 cores",
)
PRECISIONS = ("f32", "q8_0", "q4_0")
DEFAULT_K = 10  # LlamaPromptLookupDecoding's own default num_pred_tokens


def llama_cpp_source(setup: bool) -> Path:
    """llama.cpp's source tree as the binding's sdist ships it (``vendor/llama.cpp``): the
    converter that matches the library, fetched once with ``pip download``."""

    def fetch(tmp: Path) -> None:
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={VERSION}", "-d", str(tmp)], OUT / "llamacpp" / "source.log",
                   f"pip download llama-cpp-python=={VERSION} (sdist)")
        sdist = tmp / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.is_file():
            raise SetupError(f"pip download wrote no {sdist.name} into {tmp}")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        sdist.unlink()

    src = build_once(OUT / "llamacpp" / f"llama-cpp-python-{VERSION}", fetch, f"llama-cpp-python {VERSION} sources", setup)
    tree = src / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise SetupError(f"{tree} has no convert_hf_to_gguf.py: the sdist's layout changed")
    return tree


def convert_gguf(src: Path, python: Path, setup: bool) -> dict[str, Path]:
    """``src`` as GGUF files, one per precision (``model-f32.gguf``, ``model-q8_0.gguf``), cached
    under ``.bench/peers/llamacpp/<name>-<key>/``."""
    converter = Path(__file__).resolve().parents[1] / "llamacpp_convert.py"

    def build(tmp: Path) -> None:
        tree = llama_cpp_source(setup)
        for precision in PRECISIONS:
            out = tmp / f"model-{precision}.gguf"
            run_logged([str(python), str(converter), str(tree), str(src.resolve()), str(out), precision],
                       OUT / "llamacpp" / "convert.log", f"convert_hf_to_gguf {src} -> {precision}",
                       env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
            if not out.is_file():
                raise SetupError(f"convert_hf_to_gguf wrote no {out}")

    folder = build_once(OUT / "llamacpp" / f"{src.resolve().name}-{checkpoint_key(src)}", build, f"GGUF of {src}", setup)
    return {p: folder / f"model-{p}.gguf" for p in PRECISIONS}


class LlamaCppPeer(WorkerPeer):
    """llama.cpp (llama-cpp-python ``Llama.generate``) on CPU, F32 and Q8_0 weights: the target
    alone and with the binding's prompt lookup; ``tools/llamacpp_worker.py`` says how each is run
    and timed, and why there is no draft-model mode."""

    name = "llamacpp"
    modes = ("autoregressive", "speculative-lookup", "speculative-draft",
             "autoregressive-q8_0", "speculative-lookup-q8_0", "autoregressive-q4_0", "speculative-lookup-q4_0")

    def __init__(self, target: Path, threads: int, draft_tokens: int | None, ngram_size: int, n_ctx: int,
                 setup: bool = True) -> None:
        python = ensure_venv(VENV, setup)
        gguf = convert_gguf(target, python, setup)
        k = DEFAULT_K if draft_tokens is None else draft_tokens
        spec = {"gguf": {p: str(f) for p, f in gguf.items()}, "threads": threads, "k": k, "ngram_size": ngram_size,
                "n_ctx": n_ctx}
        self.worker = Worker(python, "llamacpp_worker.py", spec)
        hello = self.worker.ask({"cmd": "hello"})
        self.unavailable: dict[str, str] = hello["unavailable"]
        self.settings = {"version": hello["version"], "num_pred_tokens": k, "max_ngram_size": ngram_size,
                         "n_threads": threads, "n_ctx": n_ctx, "gguf": spec["gguf"], "input": "token ids",
                         "timing": "generate's first to last token", "system_info": hello["system_info"]}

    @classmethod
    def from_args(cls, args) -> LlamaCppPeer:
        n_ctx = args.prompt_tokens + args.tokens + 64  # room for the last round's proposals
        return cls(args.target, args.threads, args.draft_tokens, args.ngram_size, n_ctx, args.setup)

    @staticmethod
    def baseline(mode: str) -> str | None:
        """The autoregressive mode of the same precision."""
        if mode.startswith("autoregressive"):
            return None
        return "autoregressive" + next((f"-{p}" for p in PRECISIONS[1:] if mode.endswith(f"-{p}")), "")
