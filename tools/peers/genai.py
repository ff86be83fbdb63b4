"""onnxruntime-genai, driven through ``tools/genai_worker.py`` running in its private venv."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from peers.base import OUT, REPO, ModeUnavailable, Peer, Sample, checkpoint_key

VENV_ROOT = REPO / ".bench"  # genai_baseline.ensure_venv puts genai-venv/ here
VENV_PYTHON = VENV_ROOT / "genai-venv" / "bin" / "python"
WORKER = Path(__file__).resolve().parents[1] / "genai_worker.py"
DEFAULT_K = 4


def genai_models(target: Path, draft: Path, k: int) -> Path:
    """Builder graphs of target and draft plus a composite speculative config; return its folder.

    Layout: ``<pair>/target``, ``<pair>/draft`` (model builder output, fp32, CPU EP) and
    ``<pair>/genai_config.json``: the target's config with ``model.type = "speculative"``,
    ``model.draft`` = the draft's decoder block and ``speculative.max_draft_tokens = k``.
    genai 0.18 rejects ``..`` in model filenames, hence the draft and target below the config.
    """
    from genai_baseline import build  # sibling tool (tools/ is the driver's folder): venv + model builder

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


class GenaiPeer(Peer):
    """onnxruntime-genai through a worker in its venv (``tools/genai_worker.py``, JSON lines)."""

    name = "genai"
    modes = ("autoregressive", "speculative-draft", "speculative-ngram")

    def __init__(self, target: Path, draft: Path, threads: int, draft_tokens: int | None, ngram_size: int) -> None:
        if not VENV_PYTHON.exists():
            raise ModeUnavailable(f"no onnxruntime-genai venv at {VENV_PYTHON.parent.parent} "
                                  "(tools/genai_baseline.py or --setup-genai creates it)")
        k = DEFAULT_K if draft_tokens is None else draft_tokens
        pair = genai_models(target, draft, k)
        spec = {"pair": str(pair), "threads": threads, "k": k, "ngram_size": ngram_size}
        self.proc = subprocess.Popen([str(VENV_PYTHON), str(WORKER), json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        hello = self._ask({"cmd": "hello"})
        self.unavailable: dict[str, str] = hello["unavailable"]
        self.settings = {"version": hello["version"], "max_draft_tokens": k, "ngram_size": ngram_size,
                         "ort_intra_op_threads": threads, "models": str(pair)}

    @classmethod
    def from_args(cls, args) -> GenaiPeer:
        if args.setup_genai:
            from genai_baseline import ensure_venv

            ensure_venv(VENV_ROOT)
        return cls(args.target, args.draft, args.threads, args.draft_tokens, args.ngram_size)

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
