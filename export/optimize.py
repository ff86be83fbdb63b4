"""Graph optimizations for ONNX Runtime on CPU, applied before validation.

1. onnxscript's ORT fusions: RMSNorm, skip-RMSNorm, rotary embedding, cos/sin cache.
2. A tied LM head (the embedding matrix W [V, H] reused as the output projection) exports as
   MatMul(h, Wᵀ) on a transposed constant, which ORT runs as FusedMatMul(transB) and cannot
   prepack (a large share of a verify call: docs/bench/notes.md). The head becomes a plain MatMul on
   a stored Wᵀ [H, V]:

       FusedMatMul(h, W, transB=1)    ->  MatMul(h, Wᵀ)   (x alpha, where ORT folded a scale in)

   The embedding lookup keeps W only when W is tiny (<= DUPLICATE_LIMIT elements, 16 MiB in
   float32: ORT's column gather costs ~0.15 ms a call, a few percent of a small model's verify
   call, more than such a copy is worth). A real vocabulary (32k+ rows x 512+) is far above it:
   the tied matrix is stored once, as Wᵀ, and the lookup gathers its columns, which is
   negligible next to such a model's call (SmolLM2-135M: 113 MB not written twice):

       Gather(W, ids)                 ->  Transpose(Gather(Wᵀ, ids, axis=1), perm=[1, .., r, 0])
3. The fused rotary's cos/sin cache is rebuilt every call from ReduceMax(position_ids); it is
   a constant, so we evaluate that subgraph once for positions 0..max_seq-1 and store it.
4. Reshape -> Transpose -> RotaryEmbedding (4-D) -> Transpose -> Reshape around each rotary
   becomes one RotaryEmbedding on the 3-D [1, S, H*D] tensor, which the op accepts as is.
5. RotaryEmbedding on GroupQueryAttention's query and key moves into the attention op itself
   (do_rotary=1 with the same cos/sin cache; its positions are past + 0..S-1, as ours).
6. Sibling MatMuls (one input, constant weights: q/k/v, gate/up) become one MatMul on the
   concatenated weights and a Split, as hand-built graphs do: fewer, larger kernels.
7. Where that Split's three outputs are exactly GroupQueryAttention's query, key and value
   (value through a Reshape to the shape it already has), the attention reads the packed
   output itself (its packed-QKV form: key and value empty) and the Split goes:

       Split(qkv) -> q, k, Reshape(v)  ->  GQA(q, k, v, ...)      becomes      GQA(qkv, "", "", ...)

8. A Reshape of attention's output to the shape it already has ([B, -1, H*D] of [B, S, H*D])
   goes. Per layer, 7 and 8 drop three of the ~14 kernels of a decode call, each a few
   microseconds of dispatch (specdec bench --op-split).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper


DUPLICATE_LIMIT = 4 * 2**20  # elements of a tied W kept twice at most (16 MiB in float32; the demo target: 1.6M)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _is_transposed_head(node: onnx.NodeProto, inits: dict) -> bool:
    a = _attrs(node)
    return (
        node.op_type == "FusedMatMul"
        and node.input[1] in inits
        and a.get("transB", 0) == 1
        and a.get("transA", 0) == 0
        and len(inits[node.input[1]].dims) == 2
    )


def untranspose_tied_head(model: onnx.ModelProto) -> int:
    """Rewrite transposed-B heads as plain MatMuls on Wᵀ (see the module docstring); returns how many."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    ranks = {i.name: len(i.type.tensor_type.shape.dim) for i in graph.input}
    heads = [n for n in graph.node if _is_transposed_head(n, inits)]
    done = 0
    for head in heads:
        w = head.input[1]
        users = [n for n in graph.node if w in n.input and n is not head]
        gathers = [n for n in users if n.op_type == "Gather" and n.input[0] == w and _attrs(n).get("axis", 0) == 0]
        if len(gathers) != len(users):
            continue  # W has other uses we do not rewrite; leave this head alone
        keep_w = int(np.prod(inits[w].dims)) <= DUPLICATE_LIMIT
        if not keep_w and any(n.input[1] not in ranks for n in gathers):
            continue  # the column gather needs the indices' rank: known for graph inputs only
        matrix = numpy_helper.to_array(inits[w])
        wt = numpy_helper.from_array(np.ascontiguousarray(matrix.T), w + "_T")
        graph.initializer.append(wt)
        if keep_w:
            gathers = []  # lookups keep reading W
        else:
            graph.initializer.remove(inits[w])
        nodes = []
        for n in graph.node:
            if n is head and _attrs(n).get("alpha", 1.0) != 1.0:  # a scale ORT folded in (Gemma 2's 1 / final soft-cap)
                alpha = numpy_helper.from_array(np.array(_attrs(n)["alpha"], dtype=matrix.dtype), n.name + "_alpha")
                graph.initializer.append(alpha)
                nodes.append(helper.make_node("MatMul", [n.input[0], wt.name], [n.output[0] + "_unscaled"], name=n.name + "_untransposed"))
                nodes.append(helper.make_node("Mul", [n.output[0] + "_unscaled", alpha.name], list(n.output), name=n.name + "_alpha"))
            elif n is head:
                nodes.append(helper.make_node("MatMul", [n.input[0], wt.name], list(n.output), name=n.name + "_untransposed"))
            elif n in gathers:
                rank = ranks[n.input[1]]
                cols = n.output[0] + "_cols"
                nodes.append(helper.make_node("Gather", [wt.name, n.input[1]], [cols], axis=1, name=n.name + "_cols"))
                nodes.append(helper.make_node("Transpose", [cols], list(n.output), perm=[*range(1, rank + 1), 0], name=n.name + "_t"))
            else:
                nodes.append(n)
        del graph.node[:]
        graph.node.extend(nodes)
        done += 1
    return done


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            out.setdefault(i, []).append(n)
    return out


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in graph.node for o in n.output}


def _reads(node: onnx.NodeProto) -> set[str]:
    """Names a node reads: its inputs, and what the subgraphs of an If/Loop read from outside."""
    out = set(node.input)
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            out |= {i for n in g.node for i in _reads(n)}
    return out


def _prune(graph: onnx.GraphProto) -> None:
    """Drop nodes whose outputs nobody reads (repeat until stable)."""
    while True:
        used = {i for n in graph.node for i in _reads(n)} | {o.name for o in graph.output}
        keep = [n for n in graph.node if any(o in used for o in n.output)]
        if len(keep) == len(graph.node):
            return
        del graph.node[:]
        graph.node.extend(keep)


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
    _prune(probe.graph)
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
    _prune(graph)
    return len(tables)


def rotary_on_3d(model: onnx.ModelProto) -> int:
    """Fold the layout changes around each 4-D RotaryEmbedding into a 3-D one; returns how many."""
    graph = model.graph
    prod = _producers(graph)
    cons = _consumers(graph)
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
        if _attrs(t_in).get("perm") != perm or _attrs(t_out).get("perm") != perm or "rotary_embedding_dim" in _attrs(rot):
            continue
        if any(len(cons.get(n.output[0], [])) != 1 for n in (r_in, t_in)):
            continue
        new = helper.make_node(
            "RotaryEmbedding", [r_in.input[0], *rot.input[1:]], [r_out.output[0]], domain="com.microsoft",
            name=rot.name + "_3d", **_attrs(rot),
        )
        graph.node.insert(list(graph.node).index(rot), new)
        for n in (r_in, t_in, rot, t_out, r_out):
            graph.node.remove(n)
        done += 1
    return done


def rotary_into_attention(model: onnx.ModelProto) -> int:
    """GQA(Rot(q), Rot(k), ...) -> GQA(q, k, ..., cos, sin, do_rotary=1); returns how many."""
    graph = model.graph
    prod = _producers(graph)
    cons = _consumers(graph)
    done = 0
    for gqa in [n for n in graph.node if n.op_type == "GroupQueryAttention" and len(n.input) == 7]:
        rq, rk = prod.get(gqa.input[0]), prod.get(gqa.input[1])
        if not (rq and rk and rq.op_type == rk.op_type == "RotaryEmbedding"):
            continue
        aq, ak = _attrs(rq), _attrs(rk)
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


def pack_sibling_matmuls(model: onnx.ModelProto) -> int:
    """MatMul(x, W1), MatMul(x, W2), ... -> Split(MatMul(x, [W1 | W2 | ...])); returns groups packed."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    uses: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    groups: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        w = inits.get(n.input[1]) if n.op_type == "MatMul" else None
        if w is not None and len(w.dims) == 2 and uses[w.name] == 1 and w.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            groups.setdefault(n.input[0], []).append(n)
    packed = 0
    for x, nodes in groups.items():
        if len(nodes) < 2 or len({inits[n.input[1]].dims[0] for n in nodes}) != 1:
            continue
        weights = [numpy_helper.to_array(inits[n.input[1]]) for n in nodes]
        name = nodes[0].name + "_packed"
        graph.initializer.append(numpy_helper.from_array(np.concatenate(weights, axis=1), name + "_W"))
        sizes = numpy_helper.from_array(np.array([w.shape[1] for w in weights], dtype=np.int64), name + "_sizes")
        graph.initializer.append(sizes)
        first = list(graph.node).index(nodes[0])
        graph.node.insert(first, helper.make_node("Split", [name + "_out", sizes.name], [n.output[0] for n in nodes], axis=-1, name=name + "_split"))
        graph.node.insert(first, helper.make_node("MatMul", [x, name + "_W"], [name + "_out"], name=name))
        for n in nodes:
            graph.initializer.remove(inits[n.input[1]])
            graph.node.remove(n)
        packed += 1
    return packed


def _constant(graph: onnx.GraphProto, name: str) -> np.ndarray | None:
    """The value of ``name`` where it is an initializer or a Constant node's output."""
    for t in graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    for n in graph.node:
        if n.op_type == "Constant" and n.output[0] == name:
            a = _attrs(n)
            return numpy_helper.to_array(a["value"]) if "value" in a else np.asarray(a["value_ints"]) if "value_ints" in a else None
    return None


def _reshape_keeps_last(graph: onnx.GraphProto, node: onnx.NodeProto, rows: int | None, width: int) -> bool:
    """Reshape ``node`` maps a [rows, S, width] tensor to [rows, -1, width]: to itself."""
    shape = _constant(graph, node.input[1]) if node.op_type == "Reshape" else None
    if shape is None or rows is None or shape.ndim != 1 or len(shape) != 3:
        return False
    return shape[0] in (rows, 0) and shape[1] == -1 and shape[2] == width


def _batch_rows(graph: onnx.GraphProto) -> int | None:
    """The graph's static batch rows, from its first past_key input [B, kvH, MAX, D]."""
    past = next((i for i in graph.input if i.name.startswith("past_key")), None)
    dim = past.type.tensor_type.shape.dim[0] if past is not None else None
    return dim.dim_value if dim is not None and dim.HasField("dim_value") else None


def _head_size(graph: onnx.GraphProto, gqa: onnx.NodeProto) -> int:
    """D of ``gqa``'s past_key [B, kvH, MAX, D] where it is a graph input with static shape; else 0."""
    past = next((i for i in graph.input if i.name == gqa.input[3]), None) if len(gqa.input) > 3 else None
    dims = past.type.tensor_type.shape.dim if past is not None else []
    return dims[3].dim_value if len(dims) == 4 and dims[3].HasField("dim_value") else 0


def pack_qkv_into_attention(model: onnx.ModelProto) -> int:
    """Pass 7 of the module docstring; returns how many attentions read packed QKV. Biases
    (Qwen2's q/k/v) come along: Add(Split(x), b_i) -> Add(x, [b_q | b_k | b_v]) before the attention."""
    graph = model.graph
    prod, cons = _producers(graph), _consumers(graph)
    rows = _batch_rows(graph)
    done, old_biases = 0, set()
    for gqa in [n for n in graph.node if n.op_type == "GroupQueryAttention" and len(n.input) >= 3 and all(n.input[:3])]:
        a = _attrs(gqa)
        h, kvh = a["num_heads"], a["kv_num_heads"]
        reshape = prod.get(gqa.input[2])
        reshape = reshape if reshape is not None and reshape.op_type == "Reshape" else None
        heads = [gqa.input[0], gqa.input[1], reshape.input[0] if reshape else gqa.input[2]]
        adds = [prod.get(t) for t in heads]
        biases = [_constant(graph, n.input[1]) if n is not None and n.op_type == "Add" else None for n in adds]
        if all(b is not None and b.ndim == 1 for b in biases):
            heads = [n.input[0] for n in adds]
        elif any(b is not None for b in biases):
            continue
        else:
            adds = []
        split = prod.get(heads[0])
        if split is None or split.op_type != "Split" or list(split.output) != heads or _attrs(split).get("axis") not in (-1, 2):
            continue
        sizes = _constant(graph, split.input[1]) if len(split.input) > 1 else None
        d = int(sizes[0]) // h if sizes is not None and len(sizes) == 3 else 0
        if not d or sizes.tolist() != [h * d, kvh * d, kvh * d] or (adds and [len(b) for b in biases] != sizes.tolist()):
            continue
        between = [*split.output, *(n.output[0] for n in adds)]
        if any(len(cons.get(t, [])) != 1 for t in between) or (reshape and (len(cons[reshape.output[0]]) != 1 or not _reshape_keeps_last(graph, reshape, rows, kvh * d))):
            continue
        packed = split.input[0]
        if adds:
            bias = numpy_helper.from_array(np.concatenate(biases), gqa.name + "_qkv_bias")
            graph.initializer.append(bias)
            packed = gqa.name + "_qkv"
            graph.node.insert(list(graph.node).index(split), helper.make_node("Add", [split.input[0], bias.name], [packed], name=gqa.name + "_qkv_add"))
        gqa.input[0], gqa.input[1], gqa.input[2] = packed, "", ""
        old_biases.update(n.input[1] for n in adds)
        for n in (split, reshape, *adds):
            if n is not None:
                graph.node.remove(n)
        done += 1
    _prune(graph)
    read = {i for n in graph.node for i in _reads(n)}
    for t in [t for t in graph.initializer if t.name in old_biases and t.name not in read]:
        graph.initializer.remove(t)
    return done


def drop_attention_reshapes(model: onnx.ModelProto) -> int:
    """Pass 8 of the module docstring; returns how many Reshapes went."""
    graph = model.graph
    prod, cons = _producers(graph), _consumers(graph)
    rows, outputs = _batch_rows(graph), {o.name for o in graph.output}
    done = 0
    for r in [n for n in graph.node if n.op_type == "Reshape"]:
        gqa = prod.get(r.input[0])
        if gqa is None or gqa.op_type != "GroupQueryAttention" or gqa.output[0] != r.input[0] or len(cons[r.input[0]]) != 1:
            continue
        d = _head_size(graph, gqa)
        if not d or r.output[0] in outputs or not _reshape_keeps_last(graph, r, rows, _attrs(gqa)["num_heads"] * d):
            continue
        for n in cons.get(r.output[0], []):
            for i, name in enumerate(n.input):
                if name == r.output[0]:
                    n.input[i] = r.input[0]
        graph.node.remove(r)
        done += 1
    return done


def optimize_for_cpu(path: Path, max_seq: int) -> dict[str, int]:
    """Apply passes 1-8 of the module docstring to the graph at ``path`` in place; returns counts."""
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        fused_path = Path(tmp) / "fused.onnx"
        model, counts = optimize_for_ort(ir.load(str(path)))
        ir.save(model, str(fused_path), external_data="fused.onnx.data")
        del model
        proto = onnx.load(str(fused_path))
    counts = {k: v for k, v in counts.items() if v}
    counts["untransposed_head"] = untranspose_tied_head(proto)
    counts["constant_rotary_cache"] = constant_rotary_cache(proto, max_seq)
    counts["rotary_3d"] = rotary_on_3d(proto)
    counts["rotary_in_attention"] = rotary_into_attention(proto)
    counts["packed_matmuls"] = pack_sibling_matmuls(proto)
    counts["packed_qkv_attention"] = pack_qkv_into_attention(proto)
    counts["attention_reshapes"] = drop_attention_reshapes(proto)
    path.with_name(path.name + ".data").unlink(missing_ok=True)
    onnx.save(proto, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=1024)
    return counts
