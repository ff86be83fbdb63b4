"""Export the fused draft graph: γ draft steps, and the choice of each token, in ONE call.

A draft step is a small model run; called one at a time, each step pays ONNX Runtime's fixed
per-call cost and a trip through NumPy to pick its token. This graph unrolls the γ steps and
picks every token inside the graph, for B rows at once (B = 1 for the decoder):

    input_ids [B, 1] (each row's last committed token), position_ids [B, 1], seqlens_k [B]
      │  step j = 0..γ-1: the model on one token per row at position + j, its KV written in place
      │                   (one batch-1 GroupQueryAttention per row and layer, as export/batched.py)
      ▼
    logits_j [B, V] ──► standardize (per row: temperature -> top-k -> top-p, as runtime/sampling.py)
                     ──► q_j [B, V] ──► token: argmax where temperature == 0, else inverse CDF at
                                          uniforms[:, j] (drawn by the runtime from the request's RNG)
                     ──► next step's input
    outputs: tokens int64 [B, γ], probs float32 [B, γ, V] (q: what each token was drawn from),
             present_key_i_b_j / present_value_i_b_j: step j's write, bound to row b's past buffer

A second variant takes no sampling inputs and returns no probs: every row greedy, argmax only
(a call of it skips the softmax the sampling graph computes for its If; 20% of a demo draft call).

The graph is not traced: each step is a copy of the draft's exported 1-token graph of B rows
(its step graph for one row, its batched graph for B; optimized and quantized already, so the
steps are exactly the graph the step-by-step loop calls), its names prefixed ``step<j>/`` and
its weights shared, with step j's positions, seqlens_k and per-row totals (seqlens_k + j + 1)
computed in front of it. The choice of a token is ``choose`` below, traced once per process
with B and V dynamic and copied after every step. Tracing the model γ times (and optimizing
the unrolled graph) was most of a ``--fused-draft`` export.

The graph is correct only when every present output is bound to its row's past buffer (as
engines/fused.py binds them): that aliasing is how step j + 1 sees step j's KV row. Run with
unbound outputs (a plain ``session.run``), later steps would attend without the earlier ones.

Every token is drawn from exactly the q row the graph returns, so Algorithm 1 on those rows
keeps the target's law whatever rounding the graph's float32 standardization has. The draft
token x_γ is not fed (as in the step-by-step loop); its KV row is written by the next call.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper

from specdec.manifest import GraphIO, GraphSpec, TensorSpec

SAMPLING_INPUTS = (  # (name, dtype) per row, after the ids, positions and seqlens
    ("uniforms", "float32"),  # [B, γ] in [0, 1): one per drafted token
    ("temperature", "float32"),  # [B]; 0: argmax
    ("top_k", "int64"),  # [B]; 0: off
    ("top_p", "float32"),  # [B]; 1: off
)


def _filtered(logits: torch.Tensor, t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities [B, V] after temperature, top-k and top-p (one full sort per row)."""
    vocab = logits.shape[-1]
    ranked, order = torch.topk(logits / t[:, None], vocab, dim=-1)  # ONNX TopK: equal scores keep the lower index first
    # top-k: drop scores below the k-th largest (ties with it stay)
    k = torch.where(top_k > 0, torch.clamp(top_k, max=vocab), torch.full_like(top_k, vocab))
    kth = ranked.gather(1, (k - 1)[:, None])  # [B, 1]
    ranked = torch.where(ranked < kth, torch.full_like(ranked, float("-inf")), ranked)
    # top-p: a token is dropped while the mass of it and every less likely token is <= 1 - p;
    # the most likely token stays
    tail = torch.flip(torch.cumsum(torch.flip(torch.softmax(ranked, dim=-1), [-1]), -1), [-1])  # [B, V]: mass of ranks >= i
    drop = (tail <= (1.0 - top_p)[:, None]) & (torch.arange(vocab) > 0)  # (no in-place writes in an If branch)
    ranked = torch.where(drop, torch.full_like(ranked, float("-inf")), ranked)
    return torch.zeros_like(logits).scatter(1, order, torch.softmax(ranked, dim=-1))  # back to token order


def _tempered(logits: torch.Tensor, t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities [B, V] after temperature alone (no row filters: no sort)."""
    return torch.softmax(logits / t[:, None], dim=-1)


def standardize(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> probabilities [B, V]: runtime.sampling.standardize per row, in float32
    (rows with temperature 0 are standardized at temperature 1; their token is the argmax).
    The sort runs only in calls where a sampled row filters (an ONNX If)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    filtering = ((temperature > 0) & ((top_k > 0) | (top_p < 1.0))).any()
    return torch.cond(filtering, _filtered, _tempered, (logits, t, top_k, top_p))


def _sampled(probs: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens [B]: the first argmax where temperature == 0, else inverse CDF of probs [B, V]
    at u [B] (as runtime.sampling.sample: never a zero-mass token)."""
    vocab = probs.shape[-1]
    cdf = torch.cumsum(probs, dim=-1)  # [B, V]
    idx = (cdf <= (u * cdf[:, -1])[:, None]).sum(-1)  # [B]
    index = torch.arange(vocab, device=probs.device)
    last = torch.where(probs > 0, index, torch.zeros_like(index)).amax(-1)  # the last token with mass
    return torch.where(temperature > 0, torch.minimum(idx, last), logits.argmax(-1))


def _greedy(probs: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def choose(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor):
    """Each row's token [B] and the distribution [B, V] it was drawn from (not read for greedy
    rows: greedy verification compares tokens). A call where every row is greedy draws nothing
    (an ONNX If; torch.cond cannot nest, so its softmax still runs)."""
    probs = standardize(logits, temperature, top_k, top_p)
    return torch.cond((temperature > 0).any(), _sampled, _greedy, (probs, logits, temperature, u)), probs


class _Pick(torch.nn.Module):
    """One step's choice: (logits [B, V], temperature, top_k, top_p, u [B]) -> (tokens [B], q [B, V])."""

    def forward(self, logits, temperature, top_k, top_p, u):
        return choose(logits, temperature, top_k, top_p, u)


PICK_INPUTS = ("logits", "temperature", "top_k", "top_p", "u")


@functools.cache
def pick_graph() -> bytes:
    """``choose`` as an ONNX graph (serialized), B and V dynamic: traced once per process."""
    b, v = torch.export.Dim("B", min=1, max=1024), torch.export.Dim("V", min=2)
    args = (torch.randn(2, 16), torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(2), torch.full((2,), 0.5))
    with torch.no_grad():
        program = torch.onnx.export(_Pick().eval(), args, dynamo=True, input_names=list(PICK_INPUTS), output_names=["token", "q"],
                                    dynamic_shapes=({0: b, 1: v}, {0: b}, {0: b}, {0: b}, {0: b}), optimize=True, verbose=False)  # fmt: skip
    return program.model_proto.SerializeToString()


def signature(layers: int, rows: int, gamma: int, kv_heads: int, head_dim: int, vocab: int, max_seq: int, dtype: str, greedy: bool = False):
    """Inputs, outputs and I/O roles of a fused draft graph (past listed row-major; present
    step-major, each step's pairs in past's order). ``greedy``: the argmax-only graph."""
    kv = (1, kv_heads, max_seq, head_dim)
    inputs = [TensorSpec("input_ids", "int64", (rows, 1)), TensorSpec("position_ids", "int64", (rows, 1)),
              TensorSpec("seqlens_k", "int32", (rows,))]  # fmt: skip
    sampling = () if greedy else SAMPLING_INPUTS
    inputs += [TensorSpec(name, dt, (rows, gamma) if name == "uniforms" else (rows,)) for name, dt in sampling]
    outputs = [TensorSpec("tokens", "int64", (rows, gamma))]
    if not greedy:
        outputs.append(TensorSpec("probs", "float32", (rows, gamma, vocab)))
    past = [(f"past_key_{i}_{b}", f"past_value_{i}_{b}") for b in range(rows) for i in range(layers)]
    for pk, pv in past:
        inputs += [TensorSpec(pk, dtype, kv), TensorSpec(pv, dtype, kv)]
    # step-major: step j's pairs in past's order; each is bound to its past buffer
    present = [(f"present_key_{i}_{b}_{j}", f"present_value_{i}_{b}_{j}") for j in range(gamma) for b in range(rows) for i in range(layers)]
    for nk, nv in present:
        outputs += [TensorSpec(nk, dtype, kv), TensorSpec(nv, dtype, kv)]
    io = GraphIO("input_ids", "position_ids", None if greedy else "probs", tuple(past), tuple(present), seqlens="seqlens_k",
                 tokens="tokens", **{name: name for name, _ in sampling})  # fmt: skip
    return inputs, outputs, io


def _renamed(graph: onnx.GraphProto, prefix: str, names: dict[str, str]) -> list[onnx.NodeProto]:
    """Copies of ``graph``'s nodes with every value renamed: ``names`` where given, else
    ``prefix`` + name (subgraphs alike, so an If's branches keep reading what they read)."""

    def rename(v: str) -> str:
        return names.get(v, prefix + v) if v else v

    def node(n: onnx.NodeProto, k: int) -> onnx.NodeProto:
        out = onnx.NodeProto()
        out.CopyFrom(n)
        _rename_in_place(out, rename)
        out.name = prefix + (n.name or f"{n.op_type}_{k}")
        return out

    return [node(n, k) for k, n in enumerate(graph.node)]


def _rename_in_place(n: onnx.NodeProto, rename) -> None:
    ins, outs = [rename(i) for i in n.input], [rename(o) for o in n.output]
    del n.input[:], n.output[:], n.metadata_props[:]  # the exporter's per-node stack traces: most of a graph's bytes
    n.input.extend(ins)
    n.output.extend(outs)
    for a in n.attribute:
        for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
            for inner in g.node:
                _rename_in_place(inner, rename)
            for v in (*g.input, *g.output, *g.initializer):
                v.name = rename(v.name)
            del g.value_info[:]


class _Consts:
    """The small integer initializers the steps share, each made once."""

    def __init__(self):
        self.tensors: dict[str, onnx.TensorProto] = {}

    def __call__(self, value: int | list[int], kind: int = onnx.TensorProto.INT64) -> str:
        name = f"fused/{value}_{kind}".replace(" ", "")
        if name not in self.tensors:
            dims = [] if isinstance(value, int) else [len(value)]
            self.tensors[name] = helper.make_tensor(name, kind, dims, [value] if isinstance(value, int) else value)
        return name


def _step(src: onnx.ModelProto, step: GraphSpec, io: GraphIO, j: int, ids: str, const: _Consts) -> list[onnx.NodeProto]:
    """Step j: its positions, seqlens_k and per-row totals from the fused graph's inputs, then a
    copy of the 1-token graph ``src`` on ``ids`` [B, 1], writing step j's present outputs and
    ``step<j>/logits`` [B, 1, V]."""
    p, i32 = f"step{j}/", onnx.TensorProto.INT32
    names = {t.name: t.name for t in src.graph.initializer} | {step.io.ids: ids, step.io.logits: p + "logits"}
    names |= {a: b for pair, fused in zip(step.io.past, io.past) for a, b in zip(pair, fused)}
    names |= {a: b for pair, fused in zip(step.io.present, io.present[j * len(io.past) :]) for a, b in zip(pair, fused)}
    nodes = []
    if j:
        nodes += [helper.make_node("Add", [io.positions, const(j)], [p + "position_ids"], name=p + "positions"),
                  helper.make_node("Add", [io.seqlens, const(j, i32)], [p + "seqlens_k"], name=p + "seqlens")]  # fmt: skip
    names |= {step.io.positions: p + "position_ids" if j else io.positions, step.io.seqlens: p + "seqlens_k" if j else io.seqlens}
    # rows visible after step j, per row (seqlens_k + j + 1): each row's attention's total
    nodes.append(helper.make_node("Add", [io.seqlens, const(j + 1, i32)], [p + "totals"], name=p + "totals"))
    for b, total in enumerate(step.io.totals or (step.io.total,)):
        nodes.append(helper.make_node("Gather", [p + "totals", const(b)], [p + f"total_{b}"], axis=0, name=p + f"total_{b}"))
        names[total] = p + f"total_{b}"
    return nodes + _renamed(src.graph, p, names)


def _pick(pick: onnx.ModelProto | None, io: GraphIO, j: int, const: _Consts) -> tuple[list[onnx.NodeProto], str, str | None]:
    """Step j's choice from ``step<j>/logits``: nodes, the token [B, 1] and the q row [B, 1, V]
    (None in the greedy graph: an argmax)."""
    p = f"step{j}/"
    if pick is None:
        return [helper.make_node("ArgMax", [p + "logits"], [p + "token"], axis=-1, keepdims=0, name=p + "argmax")], p + "token", None
    one = const([1])
    nodes = [helper.make_node("Squeeze", [p + "logits", one], [p + "logits_2d"], name=p + "squeeze"),
             helper.make_node("Gather", [io.uniforms, const(j)], [p + "u"], axis=1, name=p + "u")]  # fmt: skip
    feeds = dict(zip(PICK_INPUTS, (p + "logits_2d", io.temperature, io.top_k, io.top_p, p + "u")))
    nodes += _renamed(pick.graph, p + "pick/", {t.name: "pick/" + t.name for t in pick.graph.initializer} | feeds)
    nodes += [helper.make_node("Unsqueeze", [p + "pick/token", one], [p + "token"], name=p + "token"),
              helper.make_node("Unsqueeze", [p + "pick/q", one], [p + "q"], name=p + "q")]  # fmt: skip
    return nodes, p + "token", p + "q"


def compose_fused(folder: Path, step: GraphSpec, path: Path, gamma: int, max_seq: int, kv_heads: int, head_dim: int, vocab: int,
                  dtype: str, greedy: bool = False):  # fmt: skip
    """Write ``path``: the fused draft graph of γ = ``gamma`` steps, each a copy of the exported
    1-token graph ``step`` (in ``folder``: the draft's step graph for one row, its batched graph of
    B rows for B, both already optimized and quantized), chained by their token choice; the
    weights stay in ``step``'s external data. Returns the graph's inputs, outputs and I/O roles."""
    src = onnx.load(str(folder / step.file), load_external_data=False)
    inputs, outputs, io = signature(len(step.io.past) // step.batch, step.batch, gamma, kv_heads, head_dim, vocab, max_seq, dtype, greedy)
    pick = None if greedy else onnx.load_from_string(pick_graph())
    const, nodes, ids, tokens, probs = _Consts(), [], io.ids, [], []
    for j in range(gamma):
        nodes += _step(src, step, io, j, ids, const)
        chosen, ids, q = _pick(pick, io, j, const)
        nodes += chosen
        tokens.append(ids)
        probs += [q] if q else []
    nodes.append(helper.make_node("Concat", tokens, [io.tokens], axis=1, name="tokens"))
    if probs:
        nodes.append(helper.make_node("Concat", probs, [io.logits], axis=1, name="probs"))
    inits = [*src.graph.initializer, *const.tensors.values()]
    opsets = {o.domain: o.version for o in src.opset_import}
    for t in pick.graph.initializer if pick is not None else ():
        inits.append(onnx.TensorProto())
        inits[-1].CopyFrom(t)
        inits[-1].name = "pick/" + t.name
    for o in pick.opset_import if pick is not None else ():
        opsets[o.domain] = max(o.version, opsets.get(o.domain, 0))
    value = lambda t: helper.make_tensor_value_info(t.name, helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype)), list(t.shape))  # noqa: E731
    graph = helper.make_graph(nodes, path.stem, [value(t) for t in inputs], [value(t) for t in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()], producer_name="specdec",
                              ir_version=max(src.ir_version, pick.ir_version if pick is not None else 0))  # fmt: skip
    onnx.save(model, str(path))
    return inputs, outputs, io
