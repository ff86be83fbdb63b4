"""The rotary passes of export/optimize.py (3-5 of its docstring): a constant cos/sin cache,
RotaryEmbedding on the 3-D tensor, and rotary moved into GroupQueryAttention."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specdec.export.onnx_graph import attrs, consumers, producers, prune


def constant_rotary_cache(model: onnx.ModelProto, max_seq: int) -> int:
    """Replace the per-call cos/sin computations feeding RotaryEmbedding with constant tables of
    ``max_seq`` rows; returns how many distinct tables are stored. Models with one RoPE base have
    one table; Gemma 3 has two (local and global layers' bases); equal tables are stored once."""
    import onnxruntime as ort

    graph = model.graph
    rotaries = [n for n in graph.node if n.op_type == "RotaryEmbedding"]
    caches = sorted({(n.input[2], n.input[3]) for n in rotaries})
    inits = {t.name for t in graph.initializer}
    if not caches or any(set(pair) & inits for pair in caches):
        return 0
    wanted = [name for pair in caches for name in pair]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    elem = next(i.type.tensor_type.elem_type for i in graph.input if i.name.startswith("past_key_0"))  # the model's dtype
    probe.graph.output.extend([helper.make_tensor_value_info(name, elem, None) for name in wanted])
    prune(probe.graph)
    needed = {i for n in probe.graph.node for i in n.input}
    kept = [t for t in probe.graph.initializer if t.name in needed]
    del probe.graph.initializer[:]
    probe.graph.initializer.extend(kept)
    if needed & ({i.name for i in graph.input} - {"position_ids"}):
        return 0  # the cache depends on more than positions: leave it
    del probe.graph.input[:]
    probe.graph.input.extend([i for i in graph.input if i.name == "position_ids"])
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    pos = next(i for i in graph.input if i.name == "position_ids")
    shape = [d.dim_value or 1 for d in pos.type.tensor_type.shape.dim]  # static [B, S], or 1 for a dynamic axis
    values = dict(zip(wanted, sess.run(wanted, {"position_ids": np.full(shape, max_seq - 1, dtype=np.int64)})))
    tables: list[tuple[np.ndarray, np.ndarray]] = []  # distinct (cos, sin) [max_seq, D/2]
    renamed = {}
    for cos, sin in caches:
        assert values[cos].shape[0] >= max_seq, values[cos].shape
        table = (values[cos][:max_seq], values[sin][:max_seq])
        k = next((k for k, t in enumerate(tables) if all(np.array_equal(a, b) for a, b in zip(t, table))), None)
        if k is None:
            k = len(tables)
            tables.append(table)
            suffix = f"_{k}" if k else ""
            graph.initializer.extend([numpy_helper.from_array(table[0], f"rotary_cos_cache{suffix}"),
                                      numpy_helper.from_array(table[1], f"rotary_sin_cache{suffix}")])  # fmt: skip
        suffix = f"_{k}" if k else ""
        renamed[(cos, sin)] = (f"rotary_cos_cache{suffix}", f"rotary_sin_cache{suffix}")
    for n in rotaries:
        n.input[2], n.input[3] = renamed[(n.input[2], n.input[3])]
    for n in [n for n in graph.node if set(n.output) & set(wanted)]:
        graph.node.remove(n)
    prune(graph)
    return len(tables)


def rotary_on_3d(model: onnx.ModelProto) -> int:
    """Fold the layout changes around each 4-D RotaryEmbedding into a 3-D one; returns how many."""
    graph = model.graph
    prod = producers(graph)
    cons = consumers(graph)
    done = 0
    for rot in [n for n in graph.node if n.op_type == "RotaryEmbedding"]:
        t_in = prod.get(rot.input[0])
        r_in = prod.get(t_in.input[0]) if t_in is not None else None
        t_out = cons.get(rot.output[0], [None])
        r_out = cons.get(t_out[0].output[0], [None]) if len(t_out) == 1 and t_out[0] is not None else [None]
        chain = (t_in, r_in, t_out[0], r_out[0]) if len(t_out) == 1 and len(r_out) == 1 else None
        if not chain or any(n is None for n in chain):
            continue
        t_in, r_in, t_out, r_out = chain
        perm = [0, 2, 1, 3]
        if (t_in.op_type, r_in.op_type, t_out.op_type, r_out.op_type) != ("Transpose", "Reshape", "Transpose", "Reshape"):
            continue
        if attrs(t_in).get("perm") != perm or attrs(t_out).get("perm") != perm or "rotary_embedding_dim" in attrs(rot):
            continue
        if any(len(cons.get(n.output[0], [])) != 1 for n in (r_in, t_in)):
            continue
        new = helper.make_node(
            "RotaryEmbedding", [r_in.input[0], *rot.input[1:]], [r_out.output[0]], domain="com.microsoft",
            name=rot.name + "_3d", **attrs(rot),
        )
        graph.node.insert(list(graph.node).index(rot), new)
        for n in (r_in, t_in, rot, t_out, r_out):
            graph.node.remove(n)
        done += 1
    return done


def rotary_into_attention(model: onnx.ModelProto) -> int:
    """GQA(Rot(q), Rot(k), ...) -> GQA(q, k, ..., cos, sin, do_rotary=1); returns how many."""
    graph = model.graph
    prod = producers(graph)
    cons = consumers(graph)
    done = 0
    for gqa in [n for n in graph.node if n.op_type == "GroupQueryAttention" and len(n.input) == 7]:
        rq, rk = prod.get(gqa.input[0]), prod.get(gqa.input[1])
        if not (rq and rk and rq.op_type == rk.op_type == "RotaryEmbedding"):
            continue
        aq, ak = attrs(rq), attrs(rk)
        if rq.input[2:] != rk.input[2:] or "rotary_embedding_dim" in aq or "rotary_embedding_dim" in ak:
            continue
        if aq.get("interleaved", 0) != ak.get("interleaved", 0) or any(len(cons[r.output[0]]) != 1 for r in (rq, rk)):
            continue
        gqa.input[0], gqa.input[1] = rq.input[0], rk.input[0]
        gqa.input.extend(rq.input[2:4])  # cos_cache, sin_cache
        gqa.attribute.extend([helper.make_attribute("do_rotary", 1), helper.make_attribute("rotary_interleaved", aq.get("interleaved", 0))])
        graph.node.remove(rq)
        graph.node.remove(rk)
        done += 1
    return done

