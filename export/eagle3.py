"""EAGLE-3 heads as their authors save them, read into specdec's feature drafter.

    is_eagle3(folder)                  whether a folder (or hub snapshot) holds an EAGLE-3 head
    read(folder) -> Eagle3Spec         its config and weights, either layout (below)
    Eagle3Head(spec, embed, head_t)    the head in PyTorch, the feature head's interface (export/head.py)
    fuse_weights(spec)                 what the target graphs compute from its auxiliary layers

Layouts read:
- vLLM's Speculators (``speculators_model_type: eagle3``): ``transformer_layer_config`` (a llama or
  qwen3 config), ``draft_vocab_size``, ``norm_before_residual``, ``eagle_aux_hidden_state_layer_ids``,
  ``norm_before_fc`` / ``fc_norm`` / ``norm_output``, ``target_hidden_size``; weights ``layers.0.*``,
  ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` and maybe ``embed_tokens``, ``input_norm``, ``fc_norm.i``.
- EAGLE's reference and SGLang's SpecForge (and AngelSlim's heads, saved the same way): a
  ``LlamaForCausalLMEagle3`` config (``draft_vocab_size``, maybe ``target_hidden_size`` and
  ``eagle_config.eagle_aux_hidden_state_layer_ids``); weights ``midlayer.*`` for ``layers.0.*``.

What the head computes, row j (token x_j, position j; g_{j-1} the fused feature before it):

    target side (in every target graph, export/features.py):
        g = fc(norm?(concat(a_l, a_m, a_h)))      a_i: the residual stream entering target layer i
    head (one decoder layer whose attention reads [norm(E[x_j]) ; hidden_norm(c_j)], 2d wide):
        c_j = g_{j-1} from the target, or the head's own feature when drafting
        h_j = layer(...) with residual c_j (hidden_norm(c_j) with norm_before_residual)
        logits_j = lm_head(norm(h_j)) over the draft vocabulary, token t = i + d2t[i]
        feature_j = h_j (norm(h_j) with norm_output): the next draft's c

The head never reads a row for position 0 (EAGLE-3 pairs x_j with g_{j-1}, from j = 1): the
manifest's ``feature.first`` is 1, and the feature drafter starts its cache there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdec.errors import ExportError
from specdec.runtime.sampling import NEVER

FAMILIES = ("llama", "qwen3")  # decoder layers EAGLE-3 heads are published with


@dataclass
class Eagle3Spec:
    """An EAGLE-3 head as read: its decoder layer's config, its flags and its weights."""

    layout: str  # "speculators" or "eagle"
    layer_config: object  # a transformers LlamaConfig / Qwen3Config (one layer)
    draft_vocab: int
    aux_layers: tuple[int, ...] | None  # None: EAGLE-3's default (2, L // 2, L - 3) of the target's L layers
    target_hidden: int  # width of the target's residual stream (fc reads 3x it)
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # layers.0.*, fc.weight, norm.weight, lm_head.weight, d2t, ...

    @property
    def width(self) -> int:
        return self.layer_config.hidden_size

    def layers_for(self, target_layers: int) -> tuple[int, ...]:
        return self.aux_layers or (2, target_layers // 2, target_layers - 3)


def is_eagle3(folder: Path) -> bool:
    """Whether ``folder`` holds an EAGLE-3 head (either layout)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    cfg = json.loads(path.read_text())
    return cfg.get("speculators_model_type") == "eagle3" or any("Eagle3" in a for a in cfg.get("architectures") or [])


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (or pytorch_model.bin)."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if files:
        return {k: v for f in files for k, v in load_file(str(f)).items()}
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        return {k: v for f in bins for k, v in torch.load(str(f), map_location="cpu", weights_only=True).items()}
    raise ExportError(f"EAGLE-3 head {folder}: no *.safetensors or pytorch_model.bin beside its config.json; download the whole folder")


def _layer_config(raw: dict):
    from transformers import AutoConfig

    kind = raw.get("model_type", "llama")
    if kind not in FAMILIES:
        raise ExportError(f"EAGLE-3 head: decoder layer model_type={kind!r}; expected one of {', '.join(FAMILIES)}")
    known = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "transformers_version")}
    if isinstance(known.get("layer_types"), list):  # copied from the target: one entry per head layer
        known["layer_types"] = known["layer_types"][: known.get("num_hidden_layers", 1)]
    return AutoConfig.for_model(kind, **known)


def read(folder: Path) -> Eagle3Spec:
    """The head in ``folder``, in whichever layout its authors saved it."""
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    state = _weights(folder)
    if raw.get("speculators_model_type") == "eagle3":
        layout, layer, aux = "speculators", _layer_config(raw["transformer_layer_config"]), raw.get("eagle_aux_hidden_state_layer_ids")
    else:  # EAGLE's reference / SpecForge: the layer's config is the file itself, its weights midlayer.*
        layout, layer = "eagle", _layer_config({**raw, "model_type": "llama"})
        aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or raw.get("eagle_aux_hidden_state_layer_ids")
        state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}
    spec = Eagle3Spec(layout, layer, int(raw.get("draft_vocab_size", layer.vocab_size)), _ids(aux), int(raw.get("target_hidden_size") or layer.hidden_size),
                      *(bool(raw.get(k)) for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")))  # fmt: skip
    if layer.num_hidden_layers != 1 or any(k.startswith("layers.1.") for k in state):
        raise ExportError(f"EAGLE-3 head {folder}: {layer.num_hidden_layers} decoder layers; specdec's feature drafter runs one-layer heads")
    spec.state = state
    return spec


def _ids(value) -> tuple[int, ...] | None:
    return tuple(int(i) for i in value) if value else None


def check_target(spec: Eagle3Spec, folder: Path, target_cfg) -> tuple[int, ...]:
    """The auxiliary layers ``spec`` reads from this target; an ExportError in one line naming
    both when they do not fit (hidden size, layers, vocabulary)."""
    layers, hidden, vocab = target_cfg.num_hidden_layers, target_cfg.hidden_size, target_cfg.vocab_size
    aux = spec.layers_for(layers)
    fc = spec.state.get("fc.weight")
    head_vocab = spec.state["t2d"].shape[0] if "t2d" in spec.state else spec.layer_config.vocab_size
    problems = []
    if spec.target_hidden != hidden or fc is None or fc.shape[1] != len(aux) * hidden:
        problems.append(f"fc reads {None if fc is None else fc.shape[1]} = {len(aux)} x {spec.target_hidden}, the target's hidden size is {hidden}")
    if head_vocab != vocab:
        problems.append(f"vocabulary {head_vocab}, the target's {vocab}")
    if not all(0 <= i <= layers for i in aux):
        problems.append(f"auxiliary layers {list(aux)}, the target has {layers}")
    if problems:
        name = getattr(target_cfg, "name_or_path", "") or "the target"
        raise ExportError(f"EAGLE-3 head {folder} does not fit target {name} ({'; '.join(problems)}); use a head trained for this target")
    return aux


def vocab_ids(spec: Eagle3Spec) -> torch.Tensor:
    """[N] the target token of each draft token: i + d2t[i] (the whole vocabulary without d2t)."""
    n = spec.draft_vocab
    d2t = spec.state.get("d2t")
    return torch.arange(n) + (d2t.long() if d2t is not None else 0)


def _family(kind: str) -> tuple:
    """(decoder layer, RMSNorm, rotary embedding) classes of an EAGLE-3 head's layer family."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3 import modeling_qwen3

    return {"llama": (modeling_llama.LlamaDecoderLayer, modeling_llama.LlamaRMSNorm, modeling_llama.LlamaRotaryEmbedding),
            "qwen3": (modeling_qwen3.Qwen3DecoderLayer, modeling_qwen3.Qwen3RMSNorm, modeling_qwen3.Qwen3RotaryEmbedding)}[kind]  # fmt: skip


def decoder_layer(cfg) -> nn.Module:
    """EAGLE-3's decoder layer of ``cfg``'s family: q/k/v read [E ; hidden], 2d wide, and a ``hidden_norm``."""
    layer_cls, norm_cls, _ = _family(cfg.model_type)
    layer = layer_cls(cfg, 0)
    attn, d, hd, bias = layer.self_attn, cfg.hidden_size, cfg.head_dim, getattr(cfg, "attention_bias", False)
    attn.q_proj, attn.k_proj, attn.v_proj = (nn.Linear(2 * d, n * hd, bias=bias) for n in (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                                                            cfg.num_key_value_heads))  # fmt: skip
    layer.hidden_norm = norm_cls(d, eps=cfg.rms_norm_eps)
    return layer


class Eagle3Head(nn.Module):
    """The head over the target's embedding ``embed`` [V, d] (or the head's own, where it saved
    one): the feature head's interface (``cfg``, ``config``, ``forward``, ``trained_state``)."""

    def __init__(self, spec: Eagle3Spec, embed: torch.Tensor, max_positions: int):
        super().__init__()
        from specdec.export.head import HeadConfig

        c = spec.layer_config
        _, norm_cls, rotary_cls = _family(c.model_type)
        d, heads, kv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.spec, self.config = spec, c
        self.layer = decoder_layer(c)
        self.norm = norm_cls(d, eps=c.rms_norm_eps)
        self.rotary = rotary_cls(c)
        self.lm_head = nn.Linear(d, spec.draft_vocab, bias=False)
        own = spec.state.get("embed_tokens.weight")
        self.register_buffer("embed", (own if own is not None else embed).float(), persistent=False)  # [V, d]
        ids = vocab_ids(spec)
        self.register_buffer("vocab_ids", ids, persistent=False)  # [N]
        vocab = self.embed.shape[0]
        whole = spec.draft_vocab == vocab and bool((ids == torch.arange(vocab)).all())
        self.cfg = HeadConfig(d, c.intermediate_size, heads, kv, hd, vocab, max_positions, float(_theta(c)), c.rms_norm_eps,
                              None if whole else spec.draft_vocab)  # fmt: skip
        mine = {k: v for k, v in spec.state.items() if k.startswith("layers.0.") or k in ("norm.weight", "lm_head.weight")}
        missing, unexpected = self.load_state_dict({k.replace("layers.0.", "layer.", 1): v.float() for k, v in mine.items()}, strict=False)
        needed = [k for k in missing if k.startswith(("layer.", "norm.", "lm_head."))]
        if needed or unexpected:
            raise ExportError(f"EAGLE-3 head: weights do not match its config (missing {needed}, unexpected {unexpected})")

    def forward(self, input_ids, position_ids, context, past_key_values=None, use_cache=False):
        """ids [B, S], positions [B, S], context [B, S, d] -> (logits [B, S, V], features [B, S, d])."""
        small, feature = self.layer_forward(input_ids, position_ids, context, past_key_values)
        full = small.new_full((*small.shape[:-1], self.cfg.vocab), NEVER, dtype=torch.float32)  # NEVER is -inf in float16
        return full.scatter(-1, self.vocab_ids.expand(*small.shape[:-1], -1), small.float()), feature

    def layer_forward(self, input_ids, position_ids, context, past_key_values=None):
        """(logits over the draft vocabulary [B, S, N], the fed-back feature [B, S, d])."""
        layer, s = self.layer, input_ids.shape[1]
        e = nn.functional.embedding(input_ids, self.embed)
        hidden = layer.hidden_norm(context)
        residual = hidden if self.spec.norm_before_residual else context
        x = torch.cat([layer.input_layernorm(e), hidden], dim=-1)  # [B, S, 2d]
        mask = None
        if past_key_values is None:  # PyTorch's own attention, no cache: causal over the S rows
            mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        a, _ = layer.self_attn(hidden_states=x, attention_mask=mask, position_embeddings=self.rotary(x, position_ids),
                               past_key_values=past_key_values, position_ids=position_ids)  # fmt: skip
        h = residual + a
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        normed = self.norm(h)
        return self.lm_head(normed), (normed if self.spec.norm_output else h)  # [B, S, N], [B, S, d]

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The head's own weights (its layer, norm and LM head; an embedding it saved)."""
        return {k: v for k, v in self.state_dict().items()}


def _theta(c) -> float:
    params = getattr(c, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(c, "rope_theta", 10000.0))


def fuse_weights(spec: Eagle3Spec) -> dict[str, np.ndarray | float]:
    """The target side of the head: ``fc`` [3t, d] (transposed for MatMul), and the norm before it:
    ``input_norm`` [3t] (one RMSNorm over the concatenation) or ``fc_norm`` [k, t] (one per
    layer), with their ``eps``."""
    st = spec.state
    out: dict[str, np.ndarray | float] = {"fc": st["fc.weight"].float().numpy().T.copy(), "eps": float(spec.layer_config.rms_norm_eps)}
    if spec.norm_before_fc:
        out["input_norm"] = st["input_norm.weight"].float().numpy()
    if spec.fc_norm:
        out["fc_norm"] = np.stack([st[f"fc_norm.{i}.weight"].float().numpy() for i in range(len(spec.aux_layers or (0, 0, 0)))])
    return out


def fused_reference(aux: list[np.ndarray], weights: dict) -> np.ndarray:
    """g [S, d] from the auxiliary layers' streams, each [S, t], as the target graphs compute it."""

    def rms(x, w):
        return x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + weights["eps"]).astype(np.float32) * w

    if "fc_norm" in weights:
        aux = [rms(a, w) for a, w in zip(aux, weights["fc_norm"])]
    x = np.concatenate(aux, axis=-1)
    if "input_norm" in weights:
        x = rms(x, weights["input_norm"])
    return (x @ weights["fc"]).astype(np.float32)
