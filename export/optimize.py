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

from specdec.export.fuse_qkv import drop_attention_reshapes, pack_qkv_into_attention, pack_sibling_matmuls
from specdec.export.fuse_rotary import constant_rotary_cache, rotary_into_attention, rotary_on_3d
from specdec.export.onnx_graph import attrs


DUPLICATE_LIMIT = 4 * 2**20  # elements of a tied W kept twice at most (16 MiB in float32; the demo target: 1.6M)


def _is_transposed_head(node: onnx.NodeProto, inits: dict) -> bool:
    a = attrs(node)
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
        gathers = [n for n in users if n.op_type == "Gather" and n.input[0] == w and attrs(n).get("axis", 0) == 0]
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
            if n is head and attrs(n).get("alpha", 1.0) != 1.0:  # a scale ORT folded in (Gemma 2's 1 / final soft-cap)
                alpha = numpy_helper.from_array(np.array(attrs(n)["alpha"], dtype=matrix.dtype), n.name + "_alpha")
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

