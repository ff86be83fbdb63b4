"""EAGLE-3 heads out: a head specdec made, saved as vLLM's Speculators saves one, so that
Speculators (and what loads its format: vLLM, SGLang) can load it, and specdec-export reads it
back through the same path as a published head (export/eagle3.py).

    new_spec(target_cfg, aux, draft_ids, embed, head_t, seed) -> Eagle3Spec   a fresh head
    save(spec, folder, verifier, gamma)                                      config.json + model.safetensors

The layout written: ``speculators_model_type: eagle3`` with ``transformer_layer_config`` (the
target's family, llama or qwen3, one layer), ``draft_vocab_size``, the auxiliary layers and the
norm flags; weights ``layers.0.*``, ``fc``, ``norm``, ``lm_head``, ``embed_tokens`` (the target's
table: Speculators leaves it unset otherwise), and ``d2t`` / ``t2d`` for a draft vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specdec.export.eagle3 import FAMILIES, Eagle3Spec, decoder_layer

SPECULATORS_VERSION = "0.9.0"  # the release the conformance test loads it with (tests/eagle3_venv.py)


def new_spec(target_cfg, aux: tuple[int, ...], draft_ids: torch.Tensor | None, embed: torch.Tensor, head_t: torch.Tensor,
             seed: int = 0, norm_before_residual: bool = False) -> Eagle3Spec:  # fmt: skip
    """A fresh head for ``target_cfg``: its decoder layer the target's family (llama's for any
    other), drawn as transformers initializes one; ``lm_head`` the target's LM head [d, V] for the
    draft tokens ``draft_ids`` [N] (None: every token), as Speculators starts one; the target's
    embedding ``embed`` [V, d]."""
    from transformers import AutoConfig

    kind = target_cfg.model_type if target_cfg.model_type in FAMILIES else "llama"
    keep = {k: v for k, v in target_cfg.to_dict().items() if k not in ("model_type", "architectures", "layer_types", "transformers_version")}
    keep.update(num_hidden_layers=1, head_dim=getattr(target_cfg, "head_dim", None) or target_cfg.hidden_size // target_cfg.num_attention_heads)
    layer_cfg = AutoConfig.for_model(kind, **keep)
    torch.manual_seed(seed)
    d, vocab = target_cfg.hidden_size, target_cfg.vocab_size
    ids = torch.arange(vocab) if draft_ids is None else draft_ids.long()
    layer = decoder_layer(layer_cfg)
    state = {f"layers.0.{k}": v.detach().clone() for k, v in layer.state_dict().items()}
    state["fc.weight"] = nn.Linear(len(aux) * d, d, bias=False).weight.detach().clone()
    state["norm.weight"] = torch.ones(d)
    state["lm_head.weight"] = head_t.float()[:, ids].T.contiguous()  # [N, d]
    state["embed_tokens.weight"] = embed.float().clone()
    if draft_ids is not None:
        state["d2t"] = ids - torch.arange(len(ids))
        state["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    return Eagle3Spec("speculators", layer_cfg, len(ids), tuple(aux), d, norm_before_residual, state=state)


def save(spec: Eagle3Spec, folder: Path, verifier: str | None, architectures: list[str], gamma: int) -> None:
    """``spec`` as Speculators saves a head: ``folder/config.json`` and ``folder/model.safetensors``.
    ``verifier``: the target's hub id or path (Speculators and vLLM read it), or None."""
    from safetensors.torch import save_file

    layer = spec.layer_config.to_diff_dict()
    layer.update(model_type=spec.layer_config.model_type, num_hidden_layers=1)
    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": spec.draft_vocab,
        "eagle_aux_hidden_state_layer_ids": list(spec.aux_layers) if spec.aux_layers else None,
        "norm_before_residual": spec.norm_before_residual,
        "norm_before_fc": spec.norm_before_fc,
        "fc_norm": spec.fc_norm,
        "norm_output": spec.norm_output,
        "target_hidden_size": None if spec.target_hidden == spec.width else spec.target_hidden,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": gamma, "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": architectures},
        },
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in spec.state.items()}, str(folder / "model.safetensors"))
