"""The graphs an export writes (``planned_graphs``): each one's model, role, tokens per call,
rows and kind (export/kinds.py), from the export's options."""

from __future__ import annotations

from typing import NamedTuple

from specdec.export.config import ExportConfig
from specdec.manifest import FUSED_ROLES


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The batched graphs' row counts: powers of two below ``max_batch``, and ``max_batch``
    (a call of n rows runs the smallest that fits; 1 row runs the batch-1 graphs)."""
    sizes = {max_batch} if max_batch > 1 else set()
    b = 2
    while b < max_batch:
        sizes.add(b)
        b *= 2
    return tuple(sorted(sizes))


class GraphPlan(NamedTuple):
    name: str
    model: str  # "target" or "draft"
    role: str  # the runtime's use: "dynamic", "verify", "step", "encoder", "fused", "fused_greedy"
    tokens: int | str | None  # per call; None: dynamic; "K": gamma + 1; "gamma": drafted per fused call; "tree": --tree-nodes
    flavour: str = "ort"
    batch: int = 1  # rows per call
    kind: str = "decoder"  # how it is exported and validated: a key of export/kinds.py KINDS


# The static graphs are their model's dynamic graph with S fixed (kind "static"): after it.
GRAPHS = (
    GraphPlan("target_dynamic", "target", "dynamic", None),
    GraphPlan("target_verify", "target", "verify", "K", kind="static"),
    GraphPlan("draft_dynamic", "draft", "dynamic", None),
    GraphPlan("draft_step", "draft", "step", 1, kind="static"),
)
# Standard ops, static shapes (the kind of graph TensorRT builds from; no TensorRT build is
# made here). Prompts use the ORT dynamic graph (both flavours share one cache layout), so
# there is no portable dynamic graph.
PORTABLE_GRAPHS = (
    GraphPlan("target_verify_portable", "target", "verify", "K", "portable", kind="portable"),
    GraphPlan("draft_step_portable", "draft", "step", 1, "portable", kind="portable"),
)


# Encoder-decoder bundles (export/seq2seq.py): each model's encoder, run once per request, and
# its decoder graphs (batch 1; with --max-batch a rows graph per model too). The ORT flavour only so far.
SEQ2SEQ_GRAPHS = (
    GraphPlan("target_encoder", "target", "encoder", None, kind="encoder"),
    GraphPlan("target_dynamic", "target", "dynamic", None, kind="seq2seq"),
    GraphPlan("target_verify", "target", "verify", "K", kind="seq2seq"),
    GraphPlan("draft_encoder", "draft", "encoder", None, kind="encoder"),
    GraphPlan("draft_dynamic", "draft", "dynamic", None, kind="seq2seq"),
    GraphPlan("draft_step", "draft", "step", 1, kind="seq2seq"),
)


def planned_graphs(cfg: ExportConfig, seq2seq: bool = False) -> tuple[GraphPlan, ...]:
    if seq2seq:  # batched: an encoder of B sources, and one rows graph per model (its 1-row body included)
        if cfg.max_batch == 1:
            return SEQ2SEQ_GRAPHS
        sizes = (1, *batch_sizes(cfg.max_batch))
        encoders = tuple(GraphPlan(f"{m}_encoder_rows", m, "encoder", None, batch=cfg.max_batch, kind="encoder_batched") for m in ("target", "draft"))
        return SEQ2SEQ_GRAPHS + encoders + tuple(GraphPlan(f"{m}_batch{b}", m, "dynamic", None, batch=b, kind="seq2seq_batched")
                                                 for b in sizes for m in ("target", "draft"))  # fmt: skip
    fused = tuple(GraphPlan(f"draft_{role}", "draft", role, "gamma", kind="fused") for role in FUSED_ROLES) if cfg.fused_draft else ()
    batched = []
    rows = (1,) if cfg.batch_graphs == "rows" else ()  # a rows graph's 1-row body (one row alone, in the same session): the dynamic graph renamed
    for b in (*rows, *batch_sizes(cfg.max_batch)) if cfg.max_batch > 1 else ():  # merged into one rows graph per model (export/pipeline.py _merge_rows)
        batched += [GraphPlan(f"{m}_batch{b}", m, "dynamic", None, batch=b, kind="batched_one" if b == 1 else "batched") for m in ("target", "draft")]
        if cfg.fused_draft and b > 1:
            batched += [GraphPlan(f"draft_{role}_batch{b}", "draft", role, "gamma", batch=b, kind="fused") for role in FUSED_ROLES]
    tree = (GraphPlan("target_tree", "target", "tree", "tree", kind="tree"),  # and its accepted rows moved on a device cache
            GraphPlan("target_move", "target", "move", None, kind="move")) if cfg.tree_nodes else ()  # fmt: skip
    plans = GRAPHS + fused + (PORTABLE_GRAPHS if cfg.portable else ()) + tuple(batched) + tree
    return plans if cfg.draft is not None else tuple(p for p in plans if p.model != "draft")  # no draft model: its graphs are not made
