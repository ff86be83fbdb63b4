"""onnxruntime-genai, driven through ``tools/genai_worker.py`` running in its private venv."""

from __future__ import annotations

import json
from pathlib import Path

from peers.base import OUT, REPO, ModeUnavailable, checkpoint_key
from peers.worker import Worker, WorkerPeer

VENV_ROOT = REPO / ".bench"  # genai_baseline.ensure_venv puts genai-venv/ here
DEFAULT_K = 4


def genai_models(target: Path, draft: Path, k: int, setup: bool = True) -> Path:
    """Builder graphs of target and draft plus a composite speculative config; return its folder.

    Layout: ``<pair>/target``, ``<pair>/draft`` (model builder output, fp32, CPU EP) and
    ``<pair>/genai_config.json``: the target's config with ``model.type = "speculative"``,
    ``model.draft`` = the draft's decoder block and ``speculative.max_draft_tokens = k``.
    genai 0.18 rejects ``..`` in model filenames, hence the draft and target below the config.
    """
    from genai_baseline import build  # sibling tool (tools/ is the driver's folder): venv + model builder

    pair = OUT / "genai" / f"{target.resolve().name}-{draft.resolve().name}-{checkpoint_key(target, draft)}"
    if not setup and not all((pair / name / "genai_config.json").is_file() for name in ("target", "draft")):
        raise ModeUnavailable(f"no model builder graphs under {pair} (--no-setup given; run without it to build them)")
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


class GenaiPeer(WorkerPeer):
    """onnxruntime-genai through a worker in its venv (``tools/genai_worker.py``, JSON lines)."""

    name = "genai"
    modes = ("autoregressive", "speculative-draft", "speculative-ngram")

    def __init__(self, target: Path, draft: Path, threads: int, draft_tokens: int | None, ngram_size: int,
                 setup: bool = True) -> None:
        from genai_baseline import ensure_venv

        python = ensure_venv(VENV_ROOT, setup)
        k = DEFAULT_K if draft_tokens is None else draft_tokens
        pair = genai_models(target, draft, k, setup)
        self.worker = Worker(python, "genai_worker.py", {"pair": str(pair), "threads": threads, "k": k, "ngram_size": ngram_size})
        hello = self.worker.ask({"cmd": "hello"})
        self.unavailable: dict[str, str] = hello["unavailable"]
        self.settings = {"version": hello["version"], "max_draft_tokens": k, "ngram_size": ngram_size,
                         "ort_intra_op_threads": threads, "models": str(pair)}

    @classmethod
    def from_args(cls, args) -> GenaiPeer:
        return cls(args.target, args.draft, args.threads, args.draft_tokens, args.ngram_size, args.setup)
