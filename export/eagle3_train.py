"""An EAGLE-3 head trained by ``specdec train-drafter --arch eagle3`` (export/train_head.py's loop).

    TrainableEagle3(spec, embed, head_t, max_positions)   the head of export/eagle3.py, plus
        fuse(f)            f [B, T, (1 + k)·d]: the target's LM-head input, then its auxiliary
                           streams (export/features.py ``streams``) -> fc(streams) [B, T, d]
        draft_logits(...)  logits over the draft vocabulary [B, T, N] and the fed-back feature
        to_spec()          the trained weights in Speculators' names (export/eagle3_save.py saves them)

What the loop reads differently from specdec's own head: ``first`` = 1 (the head never sees
position 0, as EAGLE-3 drafts), ``regress`` False (EAGLE-3 trains its distribution alone: its
fed-back feature is its layer's output, not the target's last hidden state). The LM head and the
embedding stay the target's (frozen, as Speculators trains them); the layer, its norms and fc learn.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from specdec.export.eagle3 import Eagle3Head, Eagle3Spec


class TrainableEagle3(Eagle3Head):
    first = 1
    regress = False

    def __init__(self, spec: Eagle3Spec, embed: torch.Tensor, head_t: torch.Tensor, max_positions: int):
        super().__init__(spec, embed, max_positions)
        fc = spec.state["fc.weight"]
        self.fc = nn.Linear(fc.shape[1], fc.shape[0], bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(fc.float())
        self.lm_head.weight.requires_grad_(False)
        self.register_buffer("full_head_t", head_t.float(), persistent=False)  # [d, V]: the target's distributions in training

    def fuse(self, f: torch.Tensor) -> torch.Tensor:
        """[B, T, d]: fc over the auxiliary streams, the last k·t columns of ``f``."""
        return self.fc(f[..., -self.fc.in_features :])

    def draft_logits(self, input_ids, position_ids, context, past_key_values=None, use_cache=False):
        """(logits over the draft vocabulary [B, S, N], the fed-back feature [B, S, d])."""
        return self.layer_forward(input_ids, position_ids, context, past_key_values)

    def to_spec(self) -> Eagle3Spec:
        """The trained head as an ``Eagle3Spec`` (Speculators' weight names), ready to save or export."""
        state = dict(self.spec.state)
        for k, v in self.state_dict().items():
            if k.startswith("layer."):
                state["layers.0." + k[len("layer.") :]] = v.detach().clone()
        state.update({"fc.weight": self.fc.weight.detach().clone(), "norm.weight": self.norm.weight.detach().clone(),
                      "lm_head.weight": self.lm_head.weight.detach().clone()})  # fmt: skip
        return dataclasses.replace(self.spec, state=state)


def layer_config(manifest, intermediate: int | None):
    """The head layer's config from the bundle's target (its family's where EAGLE-3 has one, else
    llama's): the target's width and attention shape; MLP ``intermediate`` [default: 8/3 d]."""
    from transformers import AutoConfig

    from specdec.export.eagle3 import FAMILIES

    t = manifest.target
    kind = t.family if t.family in FAMILIES else "llama"
    inter = intermediate or int(round(8 * t.hidden_size / 3 / 64)) * 64
    return AutoConfig.for_model(kind, hidden_size=t.hidden_size, intermediate_size=inter, num_hidden_layers=t.num_layers, num_attention_heads=t.num_heads,
                                num_key_value_heads=t.num_kv_heads, head_dim=t.head_dim, vocab_size=manifest.vocab_size,
                                max_position_embeddings=manifest.max_seq_len)  # fmt: skip


def train_eagle3(bundle, corpus: str, recipe, save=None, report=print, layers: tuple[int, ...] | None = None, checkpoint=None, seconds=None) -> dict:
    """Train an EAGLE-3 head for ``bundle``'s target on ``corpus`` and write it into the bundle
    (its fused features into the target graphs, as for a published head); ``save``: also a
    folder in Speculators' layout (export/eagle3_save.py). ``layers``: the auxiliary layers
    [default: EAGLE-3's 2, L/2, L - 3]. ``checkpoint``, ``seconds``: train_head.fit's. Returns the training record."""
    from pathlib import Path

    from specdec.export.bundle import commit
    from specdec.export.eagle3_save import new_spec, save as save_head
    from specdec.export.feature import add_eagle3, expose_features, restaged, tables
    from specdec.export.train_head import draft_vocab_ids, featured_data, fit, trainable
    from specdec.runtime.text import TextCodec

    bundle = Path(bundle)
    manifest = trainable(bundle)
    if manifest.feature is not None:
        from specdec.errors import ConfigError

        raise ConfigError(f"{bundle} already has a feature drafter, whose features its target graphs return; "
                          "train an EAGLE-3 head on an export without one (specdec-export without --feature-drafter)")
    n = manifest.target.num_layers
    aux = tuple(layers) if layers else (2, n // 2, n - 3)
    if len(set(aux)) != len(aux) or not all(0 <= i <= n for i in aux):
        from specdec.errors import ConfigError

        raise ConfigError(f"--aux-layers {','.join(map(str, aux))}: expected distinct layer ids in 0..{n} (the target has {n} layers)")
    t0 = time.perf_counter()
    with restaged(bundle) as stage:  # the data only: never committed
        staged = expose_features(stage, manifest, streams=aux)
        embed, head_t, _ = tables(stage, staged)
        train_seqs, held, described = featured_data(stage, staged, corpus, TextCodec.from_bundle(bundle, manifest), recipe, report)
    t_data, ids = time.perf_counter() - t0, draft_vocab_ids(recipe, train_seqs, manifest.vocab_size)
    embed, head_t = torch.from_numpy(embed), torch.from_numpy(head_t)
    spec = new_spec(layer_config(manifest, recipe.intermediate), aux, ids, embed, head_t, recipe.seed)
    head = TrainableEagle3(spec, embed, head_t, manifest.max_seq_len)
    fitted = fit(head, train_seqs, held, recipe, report=report, seconds=seconds, checkpoint=checkpoint)
    spec = head.to_spec()
    record = {"recipe": dataclasses.asdict(recipe), "corpus": corpus, **described, "data_seconds": round(t_data, 1), **fitted}
    report(f"held-out α(T=1) / argmax agreement: {record['held_out']['after']}")
    with restaged(bundle) as stage:
        final = add_eagle3(stage, manifest, spec, aux, {"training": "specdec train-drafter"}, None, source="specdec train-drafter (EAGLE-3)")
        if save is not None:
            save_head(spec, Path(save), manifest.target.source, [], manifest.gamma)
        commit(stage, bundle, final)
    return record
