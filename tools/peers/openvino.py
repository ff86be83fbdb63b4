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


def export_ir(src: Path, setup: bool) -> Path:
    """``src`` as OpenVINO IR at fp32 (no weight compression) with its converted tokenizer,
    cached under ``.bench/peers/openvino/<name>-<key>/``."""
    python = ensure_venv(VENV, setup)
    cli = python.parent / "optimum-cli"

    def build(tmp: Path) -> None:
        run_logged([str(cli), "export", "openvino", "--model", str(src.resolve()), "--task", "text-generation-with-past",
                    "--weight-format", "fp32", str(tmp)], OUT / "openvino" / "export.log",
                   f"optimum-cli export openvino of {src}", env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        missing = [f for f in ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml") if not (tmp / f).is_file()]
        if missing:
            raise SetupError(f"optimum-cli export of {src} wrote no {missing}: LLMPipeline needs them "
                             "(openvino-tokenizers converts the tokenizer; is tokenizer.json there?)")

    return build_once(OUT / "openvino" / f"{src.resolve().name}-{checkpoint_key(src)}", build, f"OpenVINO IR of {src}", setup)


class OpenVINOPeer(WorkerPeer):
    """OpenVINO GenAI ``LLMPipeline`` on CPU: the target alone, with the draft model, and with
    prompt lookup (``tools/openvino_worker.py`` says how each is set up and timed)."""

    name = "openvino"
    modes = ("autoregressive", "speculative-draft", "speculative-lookup")

    def __init__(self, target: Path, draft: Path, threads: int, draft_tokens: int | None, ngram_size: int,
                 setup: bool = True) -> None:
        python = ensure_venv(VENV, setup)
        k = DEFAULT_K if draft_tokens is None else draft_tokens
        spec = {"target": str(export_ir(target, setup)), "draft": str(export_ir(draft, setup)), "threads": threads,
                "k": k, "ngram_size": ngram_size}
        self.worker = Worker(python, "openvino_worker.py", spec)
        hello = self.worker.ask({"cmd": "hello"})
        self.unavailable: dict[str, str] = hello["unavailable"]
        self.settings = {"version": hello["version"], "openvino": hello["openvino"], "num_assistant_tokens": k,
                         "max_ngram_size": ngram_size, "inference_num_threads": threads, "weights": "fp32 (uncompressed)",
                         "input": "token ids (ov.Tensor)", "timing": "streamer write timestamps",
                         "target": spec["target"], "draft": spec["draft"]}

    @classmethod
    def from_args(cls, args) -> OpenVINOPeer:
        return cls(args.target, args.draft, args.threads, args.draft_tokens, args.ngram_size, args.setup)
