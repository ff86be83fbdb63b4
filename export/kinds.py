"""The registry of graph kinds: how each kind of bundle graph is exported and validated.

    KINDS[plan.kind]
      export(ctx, plan, model, spec, path) -> (inputs, outputs, io)   trace one graph to ``path``
      validate(ctx, name, graph) -> (figures key, figures) | None     against PyTorch (None: it is
                                                                      checked with another graph)
      float_only                                                      stays standard-op float: no
                                                                      ORT fusions, no quantization,
                                                                      the float tolerance

A new kind (a tree-verify graph, a feature head) is one entry here and plans that name it.
Tolerances are data (``validate.TOLERANCES``), chosen per (dtype, the model's quantization).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple


class ExportContext(NamedTuple):
    """What exporting and validating a bundle's graphs read."""

    cfg: Any  # pipeline.ExportConfig
    max_seq: int
    tmp: Path  # the staging folder the graphs are written to
    max_source: int | None  # an encoder-decoder's source tokens; None: decoder-only
    models: dict  # "target"/"draft" -> the float32 torch model (validation's reference)
    specs: dict  # "target"/"draft" -> ModelSpec
    graphs: dict  # graph name -> GraphSpec, once exported (while exporting: those before, for a derived kind)
    text: tuple[int, ...] = ()  # validate.VALIDATION_TEXT in the target's tokens (empty: no tokenizer)
    gguf_types: dict = {}  # "target"/"draft" -> the GGUF tensor types of its source (() when not a GGUF)

    def kv(self, model: str) -> tuple[int, int, int, int, str]:
        s = self.specs[model]
        return (s.num_layers, s.num_kv_heads, self.max_seq, s.head_dim, self.cfg.dtype)

    def graph(self, name: str) -> tuple[str, Any]:
        return name, self.graphs[name]


@dataclass(frozen=True)
class GraphKind:
    export: Callable
    validate: Callable
    float_only: bool = False
    derived: bool = False  # made from another graph after its optimization and quantization: neither runs again


def _export_decoder(ctx, plan, model, spec, path, tokens):
    from specdec.export.graphs import export_decoder

    return export_decoder(model, path, tokens, ctx.max_seq, spec.num_kv_heads, spec.head_dim, ctx.cfg.dtype, plan.flavour)


def _export_static(ctx, plan, model, spec, path, tokens):
    """The model's dynamic-length graph, optimized and quantized, with S fixed to ``tokens``:
    no second trace and no second optimization (they were most of a real model's export)."""
    from specdec.export.graphs import fix_tokens

    cfg = model.config
    return fix_tokens(ctx.tmp / f"{plan.model}_dynamic.onnx", path, tokens, cfg.num_hidden_layers, spec.num_kv_heads, spec.head_dim,
                      cfg.vocab_size, ctx.max_seq, ctx.cfg.dtype)  # fmt: skip


def _validate_decoder(ctx, name, g):
    """A static graph after its model's ORT dynamic graph (the dynamic graph is checked with it)."""
    from specdec.export.validate import validate_model

    if g.role == "dynamic":
        return None
    key = g.model + ("_portable" if g.flavour == "portable" else "")
    return key, validate_model(ctx.models[g.model], ctx.tmp, ctx.graph(f"{g.model}_dynamic"), (name, g), ctx.kv(g.model), seed=ctx.cfg.seed,
                               text=ctx.text)  # fmt: skip


def _export_fused(ctx, plan, model, spec, path, tokens):
    """γ copies of the model's 1-token graph of ``plan.batch`` rows (its step graph, or its batched
    graph of that many rows), optimized and quantized already: no trace of its own."""
    from specdec.export.fused import compose_fused

    step = ctx.graphs[f"{plan.model}_step" if plan.batch == 1 else f"{plan.model}_batch{plan.batch}"]
    return compose_fused(ctx.tmp, step, path, ctx.cfg.gamma, ctx.max_seq, spec.num_kv_heads, spec.head_dim, model.config.vocab_size,
                         ctx.cfg.dtype, greedy=plan.role == "fused_greedy")  # fmt: skip


def _validate_fused(ctx, name, g):
    from specdec.export.validate_rows import validate_fused

    return name, validate_fused(ctx.models[g.model], ctx.tmp, (name, g), ctx.graph(f"{g.model}_dynamic"), ctx.kv(g.model), seed=ctx.cfg.seed)


def _export_batched(ctx, plan, model, spec, path, tokens):
    from specdec.export.batched import export_batched

    return export_batched(model, path, plan.batch, ctx.max_seq, spec.num_kv_heads, spec.head_dim, ctx.cfg.dtype)


def _export_batched_one(ctx, plan, model, spec, path, tokens):
    """A rows graph's 1-row body: the model's dynamic graph under the batched graph's names."""
    from specdec.export.batched import one_row

    cfg = model.config
    return one_row(ctx.tmp / f"{plan.model}_dynamic.onnx", path, cfg.num_hidden_layers, spec.num_kv_heads, spec.head_dim, cfg.vocab_size,
                   ctx.max_seq, ctx.cfg.dtype)  # fmt: skip


def _validate_batched(ctx, name, g):
    from specdec.export.validate_rows import validate_batched

    return name, validate_batched(ctx.models[g.model], ctx.tmp, (name, g), ctx.kv(g.model), ctx.cfg.gamma + 1, seed=ctx.cfg.seed)


def _export_encoder(ctx, plan, model, spec, path, tokens):
    from specdec.export.seq2seq import export_encoder

    return export_encoder(model, path, spec.family, spec.num_layers, spec.num_heads, spec.head_dim, ctx.max_source, ctx.cfg.dtype)


def _export_seq2seq(ctx, plan, model, spec, path, tokens):
    from specdec.export.seq2seq import export_seq2seq_decoder

    shape = (spec.num_layers, spec.num_heads, spec.head_dim)
    return export_seq2seq_decoder(model, path, spec.family, tokens, ctx.max_seq, *shape, ctx.max_source, ctx.cfg.dtype)


def _validate_seq2seq(ctx, name, g):
    """Per model, at its static graph: the encoder, the dynamic graph and it, together."""
    from specdec.export.validate import validate_seq2seq

    if g.role not in ("verify", "step"):
        return None
    m = g.model
    parts = [ctx.graph(f"{m}_encoder"), ctx.graph(f"{m}_dynamic"), (name, g)]
    return m, validate_seq2seq(ctx.models[m], ctx.tmp, *parts, ctx.kv(m), ctx.max_source, seed=ctx.cfg.seed)


def _export_encoder_batched(ctx, plan, model, spec, path, tokens):
    from specdec.export.seq2seq import export_encoder_batched

    shape = (spec.num_layers, spec.num_heads, spec.head_dim)
    return export_encoder_batched(model, path, spec.family, *shape, ctx.max_source, plan.batch, ctx.cfg.dtype)


def _export_seq2seq_batched(ctx, plan, model, spec, path, tokens):
    from specdec.export.seq2seq import export_seq2seq_batched

    shape = (spec.num_layers, spec.num_heads, spec.head_dim)
    return export_seq2seq_batched(model, path, spec.family, plan.batch, ctx.max_seq, *shape, ctx.max_source, ctx.cfg.dtype)


def _validate_seq2seq_batched(ctx, name, g):
    """The rows graph of every row count, each row over its own source, the sources of a call
    encoded together by the model's batched encoder (so it is checked too)."""
    from specdec.export.validate_rows import validate_batched

    return name, validate_batched(ctx.models[g.model], ctx.tmp, (name, g), ctx.kv(g.model), ctx.cfg.gamma + 1, seed=ctx.cfg.seed,
                                  encoder=ctx.graph(f"{g.model}_encoder_rows"), max_source=ctx.max_source)  # fmt: skip


def _export_tree(ctx, plan, model, spec, path, tokens):
    from specdec.export.tree import export_tree_verify

    return export_tree_verify(model, path, tokens, ctx.max_seq, spec.num_kv_heads, spec.head_dim, ctx.cfg.dtype)


def _validate_tree(ctx, name, g):
    from specdec.export.validate import validate_tree

    return name, validate_tree(ctx.models[g.model], ctx.tmp, (name, g), ctx.graph(f"{g.model}_dynamic"), ctx.kv(g.model), seed=ctx.cfg.seed)


def _export_move(ctx, plan, model, spec, path, tokens):
    from specdec.export.kv_move import export_kv_move

    return export_kv_move(path, *ctx.kv(plan.model))


def _validate_move(ctx, name, g):
    """Checked against KVCache.keep here (an ExportError if a row lands wrong); no figures."""
    from specdec.export.kv_move import validate_kv_move

    validate_kv_move(ctx.tmp, (name, g), seed=ctx.cfg.seed)


KINDS: dict[str, GraphKind] = {
    "decoder": GraphKind(_export_decoder, _validate_decoder),  # the dynamic-length graph
    "static": GraphKind(_export_static, _validate_decoder, derived=True),  # K-token verify, 1-token step: the dynamic one, S fixed
    "portable": GraphKind(_export_decoder, _validate_decoder, float_only=True),  # standard ops, static shapes
    "fused": GraphKind(_export_fused, _validate_fused, derived=True),  # the draft's γ steps in one call, from its 1-token graph
    "batched": GraphKind(_export_batched, _validate_batched),  # B rows, each over its own cache slot
    "batched_one": GraphKind(_export_batched_one, _validate_batched, derived=True),  # a rows graph's 1-row body: the dynamic graph renamed
    "encoder": GraphKind(_export_encoder, lambda ctx, name, g: None),  # checked with its model's decoder
    "seq2seq": GraphKind(_export_seq2seq, _validate_seq2seq),  # an encoder-decoder's decoder graphs
    "encoder_batched": GraphKind(_export_encoder_batched, lambda ctx, name, g: None),  # B padded sources; checked with the rows graph
    "seq2seq_batched": GraphKind(_export_seq2seq_batched, _validate_seq2seq_batched),  # B rows, each over its slot and its own source
    "tree": GraphKind(_export_tree, _validate_tree),  # N draft-tree nodes, ancestors-only attention (export/tree.py)
    "move": GraphKind(_export_move, _validate_move, derived=True),  # a tree's accepted rows moved on the device (export/kv_move.py)
}
