"""OpenVINO GenAI, driven through ``tools/openvino_worker.py`` running in its private venv
(``.bench/openvino-venv``); target and draft exported to OpenVINO IR by optimum-intel."""

from __future__ import annotations

from pathlib import Path

from peers.base import OUT, checkpoint_key
from peers.venv import SetupError, VenvSpec, build_once, ensure_venv, run_logged
from peers.worker import Worker, WorkerPeer

# Verified together (2026-11, Python 3.11, CPU). optimum-intel requires torchvision, whose PyPI
# wheel is built against CUDA torch and fails to import next to the CPU torch wheel (and then
# breaks transformers' imports); exporting text models does not need it, so it is removed.
VENV = VenvSpec(
    name="openvino-venv",
    packages=("openvino==2026.4.1", "openvino-genai==2026.4.1.0", "openvino-tokenizers==2026.4.1.0",
              "optimum-intel[openvino]==2.2.0", "optimum==2.3.0", "transformers==5.5.4", "nncf==3.4.0",
              "torch==2.13.0"),
    remove=("torchvision",),
    probe="import openvino_genai, openvino_tokenizers, optimum.exporters.openvino",
    note="~1-2 min",
)
DEFAULT_K = 4  # num_assistant_tokens has no default in OpenVINO GenAI (None) and must be set; 4 as genai's default
# Weight formats of the target (optimum-intel's --weight-format with its defaults: int8 per
# output channel; int4 asymmetric in groups of 128, as NNCF's data-free default picks them).
# fp32 runs every mode; int8 and int4 run autoregressive only, as "autoregressive-int8" etc.
PRECISIONS = ("fp32", "int8", "int4")


def export_ir(src: Path, setup: bool, weight_format: str = "fp32") -> Path:
    """``src`` as OpenVINO IR with ``weight_format`` weights and its converted tokenizer, cached
    under ``.bench/peers/openvino/<name>-<key>[-<format>]/``."""
    python = ensure_venv(VENV, setup)
    cli = python.parent / "optimum-cli"

    def build(tmp: Path) -> None:
        run_logged([str(cli), "export", "openvino", "--model", str(src.resolve()), "--task", "text-generation-with-past",
                    "--weight-format", weight_format, str(tmp)], OUT / "openvino" / "export.log",
                   f"optimum-cli export openvino of {src}", env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        if (tmp / "openvino_model.xml").is_file() and not (tmp / "openvino_detokenizer.xml").is_file():
            convert_ids_only_tokenizer(python, src, tmp)
        missing = [f for f in ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml") if not (tmp / f).is_file()]
        if missing:
            raise SetupError(f"optimum-cli export of {src} wrote no {missing}: LLMPipeline needs them "
                             "(openvino-tokenizers converts the tokenizer; is tokenizer.json there?)")

    suffix = "" if weight_format == "fp32" else f"-{weight_format}"
    return build_once(OUT / "openvino" / f"{src.resolve().name}-{checkpoint_key(src)}{suffix}", build,
                      f"OpenVINO IR ({weight_format}) of {src}", setup)


# Run in the venv: the tokenizer of ``src`` with a plain byte-level decoder, converted by
# openvino-tokenizers into ``out``. transformers 5 rebuilds SmolLM2's tokenizer from its GGUF with
# a SentencePiece-style decoder chain (ByteFallback, Fuse, Replace "▁", ByteLevel) whose
# detokenizer openvino-tokenizers 2026.4 cannot convert; the vocabulary is GPT-2 byte-level, so
# ByteLevel alone is its decoder. The peer feeds and reads token ids only: the detokenizer must
# exist for LLMPipeline to load, and never runs.
CONVERT_TOKENIZER = r"""
import json, sys, tempfile, shutil
from pathlib import Path
import openvino as ov
from openvino_tokenizers import convert_tokenizer
from transformers import AutoTokenizer
src, out = Path(sys.argv[1]), Path(sys.argv[2])
with tempfile.TemporaryDirectory() as tmp:
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).is_file():
            shutil.copy(src / f, tmp)
    d = json.loads((Path(tmp) / "tokenizer.json").read_text())
    d["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    d["model"]["byte_fallback"] = False
    (Path(tmp) / "tokenizer.json").write_text(json.dumps(d, ensure_ascii=False))
    tok, detok = convert_tokenizer(AutoTokenizer.from_pretrained(tmp), with_detokenizer=True)
ov.save_model(tok, str(out / "openvino_tokenizer.xml"))
ov.save_model(detok, str(out / "openvino_detokenizer.xml"))
"""


def convert_ids_only_tokenizer(python: Path, src: Path, out: Path) -> None:
    """optimum-cli wrote the model but could not convert the tokenizer: convert it with a plain
    byte-level decoder (``CONVERT_TOKENIZER``), for a pipeline that only sees token ids."""
    run_logged([str(python), "-c", CONVERT_TOKENIZER, str(src.resolve()), str(out)], OUT / "openvino" / "export.log",
               f"tokenizer conversion of {src} (byte-level decoder)")


class OpenVINOPeer(WorkerPeer):
    """OpenVINO GenAI ``LLMPipeline`` on CPU: the target alone, with the draft model, and with
    prompt lookup (``tools/openvino_worker.py`` says how each is set up and timed)."""

    name = "openvino"
    modes = ("autoregressive", "speculative-draft", "speculative-lookup", "autoregressive-int8", "autoregressive-int4")

    def __init__(self, target: Path, draft: Path, threads: int, draft_tokens: int | None, ngram_size: int,
                 setup: bool = True) -> None:
        python = ensure_venv(VENV, setup)
        k = DEFAULT_K if draft_tokens is None else draft_tokens
        spec = {"target": str(export_ir(target, setup)), "draft": str(export_ir(draft, setup)), "threads": threads,
                "k": k, "ngram_size": ngram_size, "quantized": {p: str(export_ir(target, setup, p)) for p in PRECISIONS[1:]}}
        self.worker = Worker(python, "openvino_worker.py", spec)
        hello = self.worker.ask({"cmd": "hello"})
        self.unavailable: dict[str, str] = hello["unavailable"]
        self.settings = {"version": hello["version"], "openvino": hello["openvino"], "num_assistant_tokens": k,
                         "max_ngram_size": ngram_size, "inference_num_threads": threads,
                         "weights": "fp32 (uncompressed); -int8/-int4 modes: optimum-cli --weight-format int8/int4 (defaults)",
                         "input": "token ids (ov.Tensor)", "timing": "streamer write timestamps",
                         "target": spec["target"], "draft": spec["draft"]}

    @staticmethod
    def baseline(mode: str) -> str | None:
        """Speculative modes against fp32 autoregressive; the compressed targets are baselines."""
        return None if mode.startswith("autoregressive") else "autoregressive"

    @classmethod
    def from_args(cls, args) -> OpenVINOPeer:
        return cls(args.target, args.draft, args.threads, args.draft_tokens, args.ngram_size, args.setup)
