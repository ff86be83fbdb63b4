"""A draft that borrows the target's vocabulary matrices and drafts over a subset of the vocabulary.

A small draft of a real model is mostly vocabulary: SmolLM2-135M's embedding is 49152 x 576
(28M parameters, 113 MB in float32), more than the draft's own layers. So, as EAGLE-3 and
FR-Spec do, such a draft

- reads its input embedding from the target (any token the target emits can be drafted after);
- predicts over a fixed subset of V' frequent tokens only, with the target's output rows for
  them as its head: ``q`` is 0 outside the subset. The output stays exactly the target's
  (speculative sampling needs only that the drafted token was drawn from the same ``q`` the
  acceptance test reads; the residual ``max(0, p - q)`` still reaches every token).

The checkpoint folder holds only what is the draft's own, so it ships small (models/):

    config.json         a transformers config (vocab_size = the target's) with a ``specdec_draft`` entry:
                          {"vocab": "draft_vocab.json", "target_vocab_sha256": <digest of the target's
                           vocabulary the draft was trained for>, "target_vocab_chunks": <a digest per
                           1/256 of its ids: a token or two spelled otherwise by another transformers
                           passes with a warning (export/draft_spec.py)>}
    model.safetensors   the layers and the final norm (float16 or float32)
    draft_vocab.json    the V' token ids of the head, ascending

At export the draft is assembled from the loaded target: its graph outputs logits over the whole
vocabulary, FILL outside the subset (exp(FILL - max) is 0 in float32 at any temperature <= 100),
so the bundle's contract and the runtime are unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specdec.errors import ModelError
from specdec.export.draft_spec import FILL, KEY, spec_of, target_fields
from specdec.export.head import WEIGHTS_NAME as HEAD_WEIGHTS


class SubsetHead(torch.nn.Module):
    """Logits over V' tokens, scattered into the full vocabulary with FILL elsewhere."""

    def __init__(self, rows: torch.Tensor, ids: torch.Tensor, vocab: int):
        super().__init__()
        self.weight_t = torch.nn.Parameter(rows.t().contiguous(), requires_grad=False)  # [H, V']: a plain MatMul
        self.register_buffer("ids", ids.long(), persistent=False)  # [V'] ascending
        self.vocab = vocab

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        small = h @ self.weight_t  # [B, S, V']
        full = small.new_full((*small.shape[:-1], self.vocab), FILL)  # [B, S, V]
        return full.index_copy(-1, self.ids, small)


def read_vocab(folder: Path, spec: dict, vocab: int) -> torch.Tensor:
    path = folder / spec.get("vocab", "draft_vocab.json")
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"shared draft {folder}: cannot read its vocabulary subset {path.name} ({e})") from None
    t = torch.tensor(ids, dtype=torch.long)
    if t.ndim != 1 or not len(t) or int(t.min()) < 0 or int(t.max()) >= vocab or bool((t[1:] <= t[:-1]).any()):
        raise ModelError(f"shared draft {folder}: {path.name} must list ascending token ids in 0..{vocab - 1}")
    return t


def assemble(draft: torch.nn.Module, target: torch.nn.Module, ids: torch.Tensor) -> torch.nn.Module:
    """``draft`` (its own layers loaded) given the target's input embedding and a SubsetHead of
    the target's output rows for ``ids``."""
    emb = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    want = tuple(draft.get_input_embeddings().weight.shape)
    if tuple(emb.shape) != want:
        raise ModelError(
            f"shared draft: its embedding is {list(want)} but the target's is {list(emb.shape)}; "
            "a shared draft needs the target's vocabulary and hidden size"
        )
    draft.get_input_embeddings().weight = torch.nn.Parameter(emb.detach(), requires_grad=False)
    draft.lm_head = SubsetHead(head.detach()[ids], ids, emb.shape[0])
    return draft


def load(folder: Path, config: Any, target: torch.nn.Module) -> torch.nn.Module:
    """The shared draft at ``folder`` (config already read), assembled from ``target``, float32."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    spec = spec_of(config)
    ids = read_vocab(folder, spec, config.vocab_size)
    files = sorted(f for f in folder.glob("*.safetensors") if f.name != HEAD_WEIGHTS)  # a feature head may share the folder
    if not files:
        raise ModelError(f"shared draft {folder}: no .safetensors weights")
    state = {k: v.float() for f in files for k, v in load_file(str(f)).items()}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # on the CPU, not "meta": non-persistent
    # buffers (rotary inv_freq, Gemma's embed_scale) are made by the constructor, not read from the file
    own = {k for k in model.state_dict() if not k.startswith(("model.embed_tokens.", "lm_head."))}
    missing, extra = own - state.keys(), state.keys() - own
    if missing or extra:
        what = f"missing {sorted(missing)[:3]}" if missing else f"unexpected {sorted(extra)[:3]}"
        raise ModelError(f"shared draft {folder}: weights do not match its config ({what})")
    model.load_state_dict(state, strict=False)
    return assemble(model, target, ids).eval()


def save(model: torch.nn.Module, folder: Path, ids: list[int], target_tokenizer: Any, dtype=torch.float16) -> None:
    """Write the draft's own weights, its config and vocabulary subset (the training tool's output)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()
             if not k.startswith(("model.embed_tokens.", "lm_head."))}  # fmt: skip
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg[KEY] = {"vocab": "draft_vocab.json", **target_fields(target_tokenizer)}
    cfg["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (folder / "draft_vocab.json").write_text(json.dumps(sorted(int(i) for i in ids)))
