"""Runs under the side venv's Python (tests/eagle3_venv.py), with vLLM's Speculators installed:
builds a random-weight EAGLE-3 head with Speculators' own classes for a saved tiny target, saves
it as Speculators saves it (or in EAGLE's reference layout, converted the way Speculators'
converter reads it back), and writes the reference forward's draft logits on given tokens. LAYOUT
"load": the head is one specdec saved in OUT/head (export/eagle3_save.py), loaded by Speculators.

    python eagle3_reference.py JOBS_JSON

JOBS_JSON: a list of jobs [TARGET, OUT, LAYOUT, SEED, TOKENS, AUX, DRAFT_VOCAB], run in one
process (its imports take most of a job's time). For each, OUT/head: the head folder;
OUT/reference.npz: ``logits`` [T - 1, N] (row j: token j + 1 read with the target's fused
feature of position j, positions from 1, as Speculators trains), ``vocab`` [N] the target token
of each draft token.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.attention import create_float_mask
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig


def build(target: Path, aux: list[int], draft_vocab: int, seed: int, layout: str) -> Eagle3DraftModel:
    """A random head for ``target``: its decoder layer the target's family (Speculators), or
    Llama's whatever the target (EAGLE's reference and SpecForge save Llama layers only)."""
    tcfg = AutoConfig.from_pretrained(target)
    kind = "llama" if layout == "eagle" else tcfg.model_type
    keep = {k: v for k, v in tcfg.to_dict().items() if k not in ("model_type", "architectures", "layer_types")}
    keep["num_hidden_layers"] = 1
    if kind == "llama":
        keep["head_dim"] = getattr(tcfg, "head_dim", tcfg.hidden_size // tcfg.num_attention_heads)
    layer = AutoConfig.for_model(kind, **keep)
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab, norm_before_residual=seed % 2 == 1,
        eagle_aux_hidden_state_layer_ids=aux,
        speculators_config=SpeculatorsConfig(algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                                             default_proposal_method="greedy",
                                             verifier=VerifierConfig(name_or_path=None, architectures=list(tcfg.architectures or []))),
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config).eval()
    verifier = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight)
        # Every matrix drawn here (Speculators leaves lm_head unset), large enough to peak; seed 2
        # (the sampled law's case) keeps the head's q flat, so that a random head still overlaps the
        # target's p and both acceptance and rejection occur.
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, (0.05 if seed == 2 else 0.3) if name.startswith("lm_head") else 0.08)
        if model.use_draft_vocab:  # the draft vocabulary: every other target token, d2t its offsets
            ids = torch.arange(draft_vocab) * (tcfg.vocab_size // draft_vocab)
            model.d2t.copy_(ids - torch.arange(draft_vocab))
            model.t2d.zero_()
            model.t2d[ids] = True
    return model


def streams(target: Path, tokens: list[int], aux: list[int]) -> torch.Tensor:
    """[1, T, k * d]: the residual streams entering the target's layers ``aux`` (id L: the final norm's input)."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation="eager").eval()
    inner = model.model
    got: dict[int, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, kwargs, i=i: got.__setitem__(i, (args[0] if args else kwargs["hidden_states"]).detach()),
                                         with_kwargs=True)
             for i, m in [*enumerate(inner.layers), (len(inner.layers), inner.norm)]]  # fmt: skip
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return torch.cat([got[i] for i in aux], dim=-1)


def main() -> None:
    for target, out, layout, seed, tokens, aux, draft_vocab in json.loads(sys.argv[1]):
        reference(Path(target), Path(out), layout, seed, tokens, aux, draft_vocab)


def reference(target: Path, out: Path, layout: str, seed: int, tokens: list[int], aux: list[int], draft_vocab: int) -> None:
    if layout == "load":  # a head specdec saved in Speculators' layout: Speculators' own loader reads it
        model = Eagle3DraftModel.from_pretrained(str(out / "head")).eval()
        model.config.transformer_layer_config._attn_implementation = model._attn_impl = "eager"
        model._create_mask_fn = create_float_mask  # the eager path's mask (flex attention's block masks need a GPU build)
    else:
        model = build(target, aux, draft_vocab, seed, layout)
    g = streams(target, tokens, aux)  # [1, T, 3d]
    ids = torch.tensor([tokens[1:]])  # x_1..x_{T-1}, each with g of the position before (Speculators' shift_batch)
    seen = {}
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.__setitem__("logits", o.detach()))
    with torch.no_grad():
        model(hidden_states=g[:, :-1], input_ids=ids, document_ids=torch.zeros_like(ids), position_ids=torch.arange(1, len(tokens))[None], ttt_steps=1)
    hook.remove()
    head = out / "head"
    if layout != "load":
        model.save_pretrained(str(head))
    if layout == "eagle":  # EAGLE's reference / SpecForge: a LlamaForCausalLMEagle3 config, midlayer.* weights
        from safetensors.torch import load_file, save_file

        cfg = json.loads((head / "config.json").read_text())
        layer = cfg["transformer_layer_config"]
        eagle = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": cfg["draft_vocab_size"],
                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}, "norm_before_residual": cfg.get("norm_before_residual", False)}  # fmt: skip
        state = {}
        for f in head.glob("*.safetensors"):
            state.update(load_file(str(f)))
            f.unlink()
        state = {k.replace("layers.0.", "midlayer.", 1): v for k, v in state.items() if k != "embed_tokens.weight"}
        save_file(state, str(head / "model.safetensors"))
        (head / "config.json").write_text(json.dumps(eagle, indent=1))
    vocab = torch.arange(model.draft_vocab_size) + (model.d2t if model.use_draft_vocab else 0)
    np.savez(out / "reference.npz", logits=seen["logits"][0].float().numpy(), vocab=vocab.numpy())


if __name__ == "__main__":
    main()
