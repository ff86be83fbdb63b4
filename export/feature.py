"""A bundle gains a feature drafter: its target graphs return their features, and a head graph is added.

    tables(bundle, manifest)            the target's embedding [V, d] and LM head [d, V], read
                                        from its dynamic graph (float weights only)
    restaged(bundle) as stage           a staging copy of the bundle (files hard-linked), moved
                                        over the bundle by ``commit`` only when all went well
    expose_features(stage, manifest)    every target graph gets the ``features`` output
    add_head(stage, manifest, head)     the head graph, checked against PyTorch, in the manifest

Used by ``specdec train-drafter`` (export/train_head.py) and ``specdec-export --feature-drafter``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx
from onnx import numpy_helper

from specdec.errors import ExportError
from specdec.export import features
from specdec.manifest import MANIFEST_NAME, GraphSpec, Manifest, ModelSpec, TensorSpec, body_output, inside, sha256_of

HEAD_GRAPH = "head_dynamic"
MAX_HEAD_DIFF = 2e-3  # |Δ logits| of the head graph vs PyTorch, float32: GQA's fused kernels reorder sums (~1e-5 seen)
# A head in int8 blocks (MatMulNBits, activations rounded to int8 per block at accuracy level 4)
# against PyTorch in float32, as a fraction of the logits' range: each rounding moves a product
# by at most 1/254 of its block's largest term, which through the head's layer came to ~1% of
# the range on SmolLM2-135M's head (0.37 of 38); a wrong graph is off by the range itself.
MAX_QUANTIZED_HEAD_DIFF = 0.05
# A float16 head (a float16 bundle's) against PyTorch in float32, as a fraction of the logits'
# range: float16 keeps 11 significant bits (each rounding ~5e-4 relative); through fc, the layer
# and the LM head it came to 0.023-0.028 of a range of ~41 on SmolLM2-135M's head (0.07 %, three
# seeds); 0.01 leaves 14x that, and a wrong graph is off by the range itself.
MAX_FLOAT16_HEAD_DIFF = 0.01


def _external_array(folder: Path, t: onnx.TensorProto) -> np.ndarray:
    """An initializer's values, read from its external-data file in ``folder`` (or inline)."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(t)
    info = {e.key: e.value for e in t.external_data}
    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
    count = int(np.prod(t.dims))
    data = np.fromfile(inside(folder, info["location"]), dtype=dtype, count=count, offset=int(info.get("offset", 0)))
    return data.reshape(tuple(t.dims))


def tables(bundle: Path, manifest: Manifest) -> tuple[np.ndarray, np.ndarray, bool]:
    """The target's embedding [V, d] and LM head [d, V] as float32 arrays, from its dynamic graph,
    and whether the graph embeds by gathering columns of the LM head itself (a tied head stored
    once, export/optimize.py): the head graph then does the same, so its file shares that tensor.

    A quantized target (export/quantize.py) keeps its embedding float32 and its LM head in
    q8_0 blocks (``MatMulBlocks`` format q8_0, or ``MatMulNBits``, 8 bits, no zero point). Its LM head is read back as the
    float weights those blocks hold: the float table itself when it is tied (its gather table,
    whose q8_0 blocks the head's own quantization gives back exactly), else the dequantized
    blocks (q8_0 is idempotent, export/blocks.py)."""
    name, g = manifest.graph("target", "dynamic")
    proto = onnx.load(str(inside(bundle, g.file)), load_external_data=False)
    inits = {t.name: t for t in proto.graph.initializer}
    gather = next((n for n in proto.graph.node if n.op_type == "Gather" and n.input[1] == g.io.ids and n.input[0] in inits), None)
    _, head = features.head_input(proto.graph, g.io.logits)
    floats = head.op_type in ("MatMul", "FusedMatMul", "Gemm")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in head.attribute}
    from specdec.engines.blocks_op import FORMATS

    blocked = head.op_type == "MatMulNBits" and attrs.get("bits") == 8 and len(head.input) == 3
    gguf = head.op_type == "MatMulBlocks" and attrs.get("format") == FORMATS["q8_0"]
    if gather is None or not (floats or blocked or gguf) or head.input[1] not in inits:
        raise ExportError(f"graph {name}: a feature drafter needs the target's float embedding and an LM head in float "
                          f"or q8_0 blocks (found {head.op_type}); export the target float32 or with --quantize int8/int4")  # fmt: skip
    axis = next((onnx.helper.get_attribute_value(a) for a in gather.attribute if a.name == "axis"), 0)
    table = _external_array(bundle, inits[gather.input[0]]).astype(np.float32)
    embed = table.T if axis == 1 else table  # [V, d]
    if blocked or gguf:
        tied = axis == 1 and head.input[1] == gather.input[0] + ("_q8" if blocked else "_q8_0")  # export/quantize.py names a weight's blocks so
        if tied:
            w = table
        elif gguf:
            from specdec.export.blocks import dequantize_column_blocks

            w = dequantize_column_blocks(_external_array(bundle, inits[head.input[1]]), "q8_0", attrs["K"], n=attrs["N"])
        else:
            from specdec.export.blocks import dequantize_q8_0

            k, n = attrs["K"], attrs["N"]
            codes = _external_array(bundle, inits[head.input[1]]).reshape(n, k // attrs["block_size"], attrs["block_size"])
            w = dequantize_q8_0(codes, _external_array(bundle, inits[head.input[2]]).reshape(n, -1))
    else:
        w = _external_array(bundle, inits[head.input[1]]).astype(np.float32)
        w = w.T if attrs.get("transB", 0) else w
        if head.op_type == "FusedMatMul" and attrs.get("alpha", 1.0) != 1.0:
            w = w * attrs["alpha"]
        tied = axis == 1 and gather.input[0] == head.input[1] and not attrs.get("transB", 0)
    if w.shape != (embed.shape[1], manifest.vocab_size):
        raise ExportError(f"graph {name}: LM head weight {list(w.shape)}, expected [{embed.shape[1]}, {manifest.vocab_size}]")
    return embed, w, tied


@contextlib.contextmanager
def restaged(bundle: Path) -> Iterator[Path]:
    """A staging folder beside ``bundle`` holding its files (hard links where the filesystem
    allows, else copies; a file is edited by writing a new one, never in place): edit it, then
    ``export.bundle.commit`` it over the bundle."""
    from specdec.export.bundle import staging

    with staging(bundle) as tmp:
        for src in bundle.rglob("*"):
            if src.name == MANIFEST_NAME and src.parent == bundle:
                continue  # written by commit: never through a link to the bundle's own file
            dst = tmp / src.relative_to(bundle)
            if src.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
        yield tmp


def expose_features(stage: Path, manifest: Manifest, fused: dict | None = None, streams: tuple[int, ...] | None = None) -> Manifest:
    """Every target graph of the staged bundle also returns ``features`` [B, S, d]: the LM head's
    input, or with ``fused`` (an EAGLE-3 head: ``eagle3.fuse_weights`` plus "layers", the
    auxiliary layers' ids) fc(norm?(concat(the streams entering those layers))), its weights in
    one file every target graph reads (``FUSED_WEIGHTS``); or with ``streams`` (layer ids: what an
    EAGLE-3 head trains on) [the LM head's input, those streams], (1 + k)·d wide."""
    d = manifest.target.hidden_size
    width = d if fused is None else fused["fc"].shape[1]
    make, tensors = None, []
    if streams is not None:
        width, make = (1 + len(streams)) * d, features.streams(tuple(streams), manifest.target.num_layers, d)
    elif fused is not None:
        tensors = _fused_tensors(stage, fused)
        names = {t.name.removeprefix("eagle3."): t.name for t in tensors}
        make = features.fused(tuple(fused["layers"]), manifest.target.num_layers, manifest.target.hidden_size, fused["eps"], names)
    graphs = dict(manifest.graphs)
    for name, g in manifest.graphs.items():
        if g.model != "target" or g.io.features or not g.io.logits:  # not the move graph (export/kv_move.py)
            continue
        path = inside(stage, g.file)
        proto = onnx.load(str(path), load_external_data=False)
        proto.graph.initializer.extend(tensors)
        features.expose(proto, g.io.logits, width, g.rows, make)
        path.unlink()  # a hard link to the bundle's file: write a new one
        onnx.save_model(proto, str(path))
        out = g.outputs
        for b in g.rows or (0,):  # a rows graph: every body's (export/rows.py)
            logits = next(t for t in g.outputs if t.name == (body_output(g.io.logits, b, g.batch) if g.rows else g.io.logits))
            feature = body_output(features.FEATURES, b, g.batch) if g.rows else features.FEATURES
            out = (*out, TensorSpec(feature, "float32", (*logits.shape[:-1], width)))
        data = tuple(sorted({*g.data, FUSED_WEIGHTS})) if tensors else g.data
        graphs[name] = dataclasses.replace(g, sha256=sha256_of(path), outputs=out, io=dataclasses.replace(g.io, features=features.FEATURES), data=data)
    return dataclasses.replace(manifest, graphs=graphs)


FUSED_WEIGHTS = "eagle3.weights"  # the fused features' fc and norms, read by every target graph


def _fused_tensors(stage: Path, fused: dict) -> list[onnx.TensorProto]:
    """``fused``'s arrays written once to ``FUSED_WEIGHTS``, as initializers pointing into it."""
    from specdec.export.weights import point

    arrays = {"fc": fused["fc"]}
    if "input_norm" in fused:
        arrays["input_norm"] = fused["input_norm"]
    for k, w in enumerate(fused.get("fc_norm", ())):
        arrays[f"fc_norm.{k}"] = w
    out, offset = [], 0
    (stage / FUSED_WEIGHTS).unlink(missing_ok=True)  # a staged copy may hard-link the bundle's own file: write a new one
    with open(stage / FUSED_WEIGHTS, "wb") as f:
        for key, a in arrays.items():
            data = np.ascontiguousarray(a, dtype=np.float32).tobytes()
            f.write(data)
            t = numpy_helper.from_array(np.zeros(0, np.float32), f"eagle3.{key}")
            t.ClearField("raw_data")
            t.dims[:] = a.shape
            t.data_location = onnx.TensorProto.EXTERNAL
            point(t, FUSED_WEIGHTS, offset, len(data))
            offset += len(data)
            out.append(t)
    return out


def add_head(stage: Path, manifest: Manifest, head, record: dict, seed: int = 0, quantize: str | None = None,
             source: str = "specdec train-drafter") -> Manifest:  # fmt: skip
    """Export ``head`` (export/head.py) into the staged bundle, its embedding and LM head pointing
    at the target's weights, checked against PyTorch; returns the manifest with it.

    quantize: None (float32), or a ``PRECISIONS`` name of export/quantize.py: the head's matrices
    in that precision's blocks, its draft-vocabulary LM head in q8_0 (the same blocks as the
    target's own LM head for those tokens); its embedding stays the target's float table."""
    from specdec.export.head import export_head
    from specdec.export.optimize import optimize_for_cpu
    from specdec.export.quantize import quantize_weight_only, scheme_for
    from specdec.export.weights import share_with

    for f in (*stage.glob(f"{HEAD_GRAPH}.onnx*"), stage / "head.weights"):  # links to an older head's files
        f.unlink(missing_ok=True)
    file = f"{HEAD_GRAPH}.onnx"
    inputs, outputs, io = export_head(head, stage / file, manifest.max_seq_len, manifest.dtype)
    optimize_for_cpu(stage / file, manifest.max_seq_len)
    if quantize:  # a drafter needs no row invariance: ONNX Runtime's MatMulNBits, so a float32 bundle needs no kernel library
        quantize_weight_only(stage / file, quantize, scheme_for(quantize, kernel="nbits"))
    base = [g.file for g in manifest.graphs.values() if g.model == "target"]
    shared = share_with(stage, "head", file, base)
    data = sorted({(e.value) for t in onnx.load(str(stage / file), load_external_data=False).graph.initializer
                   for e in t.external_data if e.key == "location"})  # fmt: skip
    graph = GraphSpec(file, sha256_of(stage / file), "head", "dynamic", None, inputs, outputs, io, tuple(data))
    cfg = head.cfg
    params = sum(p.numel() for p in head.trained_state().values() if p.is_floating_point())
    spec = ModelSpec(source, None, "feature-head", 1, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.width,
                     cfg.max_positions, int(params), quantize)  # fmt: skip
    graphs = {n: g for n, g in manifest.graphs.items() if g.model != "head"}
    graphs[HEAD_GRAPH] = graph
    relative = MAX_QUANTIZED_HEAD_DIFF if quantize else MAX_FLOAT16_HEAD_DIFF if manifest.dtype == "float16" else None
    diff = check_head(stage, graph, head, manifest.max_seq_len, seed, relative)
    feature = {"width": cfg.width, "training": record, "check": {"max_abs_logits": diff}, **shared}
    return dataclasses.replace(manifest, graphs=graphs, head=spec, feature=feature)


def add_eagle3(stage: Path, manifest: Manifest, spec, layers: tuple[int, ...], record: dict, quantize: str | None, source: str) -> Manifest:
    """An EAGLE-3 head (``export.eagle3.Eagle3Spec``, reading the target's ``layers``) into the
    staged bundle: the target graphs return its fused features, the head graph is added (checked
    against PyTorch), and the head's cache starts at position 1 (``feature.first``)."""
    import torch

    from specdec.export.eagle3 import Eagle3Head, fuse_weights

    embed, _, _ = tables(stage, manifest)
    manifest = expose_features(stage, manifest, {**fuse_weights(spec), "layers": layers})
    head = Eagle3Head(spec, torch.from_numpy(embed), manifest.max_seq_len)
    record = {"format": f"eagle3 ({spec.layout})", "aux_layers": list(layers), **record}
    manifest = add_head(stage, manifest, head, record, quantize=quantize, source=source)
    return dataclasses.replace(manifest, feature={**manifest.feature, "first": 1, "width": spec.width})


def check_head(stage: Path, graph: GraphSpec, head, max_seq: int, seed: int, relative: float | None = None) -> float:
    """Max |Δ logits| of the head graph against PyTorch (float32) over a prompt chunk and 1-token
    steps, as the drafter calls it, on the tokens it drafts; an ExportError past
    ``MAX_HEAD_DIFF`` (float32), or past ``relative`` of the logits' range (int8 blocks:
    ``MAX_QUANTIZED_HEAD_DIFF``; float16: ``MAX_FLOAT16_HEAD_DIFF``)."""
    from specdec.engines.kv import KVCache
    from specdec.engines.ort import runner_for
    from specdec.export.head import NEVER, reference

    rng = np.random.default_rng(seed)
    cfg = head.cfg
    n = min(24, max_seq)
    ids = rng.integers(0, cfg.vocab, n)
    context = rng.standard_normal((n, cfg.width)).astype(np.float32)
    want, _ = reference(head, ids, context)
    cache = KVCache(1, cfg.num_kv_heads, max_seq, cfg.head_dim, next(t.dtype for t in graph.inputs if t.name == graph.io.past[0][0]))
    runner = runner_for(stage, HEAD_GRAPH, graph, cache)
    got = []
    for a, b in ((0, n // 2), *((i, i + 1) for i in range(n // 2, n))):
        got.append(runner.run(ids[a:b], context[a:b]).copy())
        cache.append(b - a)
    drafted = want > NEVER / 2  # [S, V]: a head with a draft vocabulary gives the rest NEVER
    diff = float(np.abs(np.concatenate(got) - want)[drafted].max())
    bound = relative * float(np.ptp(want[drafted])) if relative else MAX_HEAD_DIFF
    if not diff <= bound:
        raise ExportError(f"head graph differs from PyTorch by {diff:.3g} in logits (bound {bound:.3g}); the export is wrong")
    return diff
