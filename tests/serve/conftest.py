"""A real ``specdec serve`` process on a free loopback port, and the bundle it serves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from specdec.serve.process import ServerProcess  # noqa: E402

KEY = "test-key-0123"
# A template in the usual shape (role headers, special tokens written by the template itself).
TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)


class Server(ServerProcess):
    """A server for one test module: started with ``--log-level warning``, without the
    environment's API key, ready (bounded wait) when built."""

    def __init__(self, bundle: Path, *args: str, log: Path, ready_within: float = 120.0):
        env = {k: v for k, v in os.environ.items() if k != "SPECDEC_API_KEY"}  # the key is an argument or nothing
        super().__init__(bundle, "--log-level", "warning", *args, log=log, env=env)
        self.wait_ready(ready_within)


@pytest.fixture(scope="session")
def chat_bundle(tmp_path_factory):
    """A llama pair whose tokenizer has a chat template, exported with γ = 4, max-seq-len 512
    and batched graphs for 2 and 4 rows; the draft is a noisy copy (accepts and rejects)."""
    pytest.importorskip("torch")
    from models import save_pair
    from transformers import AutoTokenizer

    from specdec.export.pipeline import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("serve")
    target, draft = save_pair(root, "llama", near=0.1)
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(target)
    out = root / "bundle"
    export_bundle(ExportConfig(str(target), str(draft), out, gamma=4, max_seq_len=512, max_batch=4))
    return target, out


@pytest.fixture(scope="session")
def server(chat_bundle, tmp_path_factory):
    """The shared server: the chat bundle, 4 rows, an API key, model name "tiny", CORS for one origin."""
    s = Server(chat_bundle[1], "--max-batch", "4", "--max-queue", "16", "--served-model-name", "tiny", "--api-key", KEY,
               "--allowed-origins", "http://localhost:3000",
               log=tmp_path_factory.mktemp("logs") / "server.log")  # fmt: skip
    yield s
    s.close()


@pytest.fixture(scope="session")
def slow_bundle(tmp_path_factory):
    """A wider llama (hidden 512, 4 layers: ~1 ms a token here, against ~0.2 ms for the tiny
    ones) so that a request of a few hundred tokens is still running when a test disconnects
    or sends SIGTERM. Its own noisy copy drafts; no batched graphs."""
    pytest.importorskip("torch")
    from models import make_tokenizer, near_copy, peaked_model
    from transformers import AutoConfig

    from specdec.export.pipeline import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("slow")
    cfg = AutoConfig.for_model("llama", vocab_size=320, bos_token_id=0, eos_token_id=1, pad_token_id=2, hidden_size=512, intermediate_size=1024,
                               num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)  # fmt: skip
    target = peaked_model(cfg, 0, inner=1.5)  # x4 at this width drifts past the export tolerance
    folders = []
    for name, model in (("target", target), ("draft", near_copy(target, 0.1, 1))):
        folder = root / name
        model.save_pretrained(folder, safe_serialization=True)
        make_tokenizer(folder)
        folders.append(folder)
    out = root / "bundle"
    export_bundle(ExportConfig(str(folders[0]), str(folders[1]), out, gamma=4, max_seq_len=512))
    return out
