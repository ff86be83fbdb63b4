"""Section 1 of ``specdec check``: is this bundle the one that was exported, and does this box
run it with what it was validated with?

- files: every file's size and digest against the manifest (as ``specdec inspect``);
- graphs: each graph's declared inputs and outputs against the manifest's I/O contract (names,
  element types, static dimensions), read with ``onnx`` when installed (no weights loaded),
  else from an ONNX Runtime session per graph;
- versions: the ONNX Runtime and specdec the bundle was validated with against the ones here
  (a difference is reported, not failed: the exactness section decides).
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

from specdec.commands.check.items import Item
from specdec.errors import BundleError

SECTION = "integrity"
ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(bool)": "bool"}


def files(bundle: Path) -> tuple[Item, object | None]:
    """The digest check, and the manifest when it passed."""
    from specdec.manifest import load_manifest

    try:
        m = load_manifest(bundle, verify="full", stamps=False)
    except BundleError as e:
        return Item(SECTION, "files", False, str(e), "re-copy the bundle from its source, or re-export it"), None
    n = len(m.integrity["files"]) if m.integrity else len(m.graphs)
    what = f"{n} files match their {m.integrity['algorithm']} digests" if m.integrity else f"{n} graphs match their sha256 (an older bundle: weights unhashed)"
    return Item(SECTION, "files", True, what), m


def _declared_onnx(path: Path) -> tuple[list, list]:
    import onnx
    from onnx import helper

    g = onnx.load(str(path), load_external_data=False).graph

    def one(v):
        t = v.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)
        return v.name, str(helper.tensor_dtype_to_np_dtype(t.elem_type)), dims

    inits = {i.name for i in g.initializer}
    return [one(v) for v in g.input if v.name not in inits], [one(v) for v in g.output]


def _declared_ort(path: Path) -> tuple[list, list]:
    import onnxruntime as ort

    from specdec.engines import blocks_op

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    blocks_op.register(opts)  # int8/int4 graphs' ai.specdec ops
    s = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])

    def one(a):
        return a.name, ORT_TYPES.get(a.type, a.type), tuple(d if isinstance(d, int) else None for d in a.shape)

    return [one(a) for a in s.get_inputs()], [one(a) for a in s.get_outputs()]


def contract_errors(name: str, spec, declared: tuple[list, list]) -> list[str]:
    """What differs between graph ``name``'s manifest entry and what its file declares."""
    errors = []
    for kind, want, have in (("input", spec.inputs, declared[0]), ("output", spec.outputs, declared[1])):
        have = {n: (dtype, dims) for n, dtype, dims in have}
        for t in want:
            if t.name not in have:
                errors.append(f"graph {name} ({spec.file}) has no {kind} {t.name!r}")
                continue
            dtype, dims = have[t.name]
            if dtype != t.dtype:
                errors.append(f"graph {name} ({spec.file}) {kind} {t.name!r} is {dtype}, the manifest says {t.dtype}")
            static = [(i, w, h) for i, (w, h) in enumerate(zip(t.shape, dims)) if isinstance(w, int) and isinstance(h, int) and w != h]
            if len(dims) != len(t.shape) or static:
                errors.append(f"graph {name} ({spec.file}) {kind} {t.name!r} has shape {list(dims)}, the manifest says {list(t.shape)}")
        extra = sorted(set(have) - {t.name for t in want})
        if extra:
            errors.append(f"graph {name} ({spec.file}) has {kind}s the manifest does not name: {', '.join(extra)}")
    return errors


def graphs(bundle: Path, m) -> Item:
    """Every graph's I/O against the manifest's."""
    try:
        import onnx  # noqa: F401

        declared, how = _declared_onnx, "read with onnx"
    except ImportError:
        declared, how = _declared_ort, "read by ONNX Runtime (pip install onnx reads them without loading weights)"
    errors = []
    for name, spec in m.graphs.items():
        errors += contract_errors(name, spec, declared(bundle / spec.file))
    if errors:
        return Item(SECTION, "graphs", False, f"{errors[0]}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""),
                    "the graph files do not belong to this manifest: re-export the bundle")  # fmt: skip
    return Item(SECTION, "graphs", True, f"{len(m.graphs)} graphs declare the manifest's inputs and outputs ({how})")


def versions(m) -> Item:
    """The runtime versions validated with against these; informational."""
    from specdec import __version__

    now = {"onnxruntime": md.version("onnxruntime"), "specdec": __version__}
    diff = [f"{k} {m.tools[k]} → {v}" for k, v in now.items() if m.tools.get(k) and m.tools[k] != v]
    if diff:
        return Item(SECTION, "versions", None, f"validated with other versions than here: {'; '.join(diff)}; the exactness checks below ran on these")
    return Item(SECTION, "versions", True, "validated with the versions here (" + ", ".join(f"{k} {v}" for k, v in now.items()) + ")")


def check(bundle: Path) -> tuple[list[Item], object | None]:
    """The section's items, and the manifest when the files are intact (else the other sections cannot run)."""
    item, m = files(bundle)
    if m is None:
        return [item], None
    return [item, graphs(bundle, m), versions(m)], m
