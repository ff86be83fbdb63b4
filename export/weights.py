"""Weights once on disk: every graph of a model reads one external-data file, ``<model>.weights``.

A model's graphs (dynamic-length, static, batched, portable) are traced and optimized one by
one, so each arrives with its own ``.onnx.data`` holding the same weights under other names
(the exporter names constants ``val_108`` in one graph, ``val_106`` in the next). Here each
distinct tensor, keyed by dtype, shape and the sha256 of its bytes, is written once; every
graph's initializer is pointed at its offset, and the per-graph data files are removed.

Offsets are aligned so that ONNX Runtime can memory-map the tensors: 64 KiB (the allocation
granularity of Windows, a multiple of every Linux page size) for tensors of 64 KiB and more,
64 bytes for smaller ones.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import onnx

from specdec.errors import ExportError

BIG = 1 << 16  # tensors this large start on a 64 KiB boundary
SMALL_ALIGN = 64


@dataclass(frozen=True)
class SharedWeights:
    """What ``share_weights`` wrote for one model."""

    file: str | None  # relative to the bundle; None when the graphs hold no external tensor
    bytes: int  # size of the file
    tensors: int  # distinct tensors in it
    referenced: int  # initializers pointing into it, over every graph
    replaced: int  # bytes of the per-graph data files it replaced


def _external(t: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def _read(folder: Path, info: dict[str, str], handles: dict[str, object]) -> bytes:
    loc = info["location"]
    if loc not in handles:
        path = (folder / loc).resolve()
        if folder.resolve() not in path.parents:
            raise ExportError(f"external data {loc!r} leaves the staging folder {folder}; the exporter wrote an unexpected path")
        handles[loc] = open(path, "rb")
    f = handles[loc]
    f.seek(int(info.get("offset", 0)))
    n = int(info["length"]) if "length" in info else -1
    data = f.read(n)
    if n >= 0 and len(data) != n:
        raise ExportError(f"external data {loc!r} ends before offset {info.get('offset', 0)} + {n}; the export is corrupt")
    return data


def _append(out, data: bytes) -> int:
    """Write ``data`` at the next aligned offset of ``out``; returns that offset."""
    align = BIG if len(data) >= BIG else SMALL_ALIGN
    pos = -(-out.tell() // align) * align
    out.write(b"\0" * (pos - out.tell()))
    out.write(data)
    return pos


def point(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make initializer ``t`` read ``length`` bytes at ``offset`` of ``location``."""
    del t.external_data[:]
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = k, v


def share_weights(folder: Path, model: str, graph_files: list[str]) -> SharedWeights:
    """Rewrite ``graph_files`` (in ``folder``) to read one ``<model>.weights``; returns its figures."""
    target = f"{model}.weights"
    offsets: dict[tuple, int] = {}  # (dtype, dims, sha256) -> offset
    handles: dict[str, object] = {}
    old_files: set[str] = set()
    referenced = 0
    protos = {}
    with open(folder / target, "wb") as out:
        try:
            for file in graph_files:
                proto = onnx.load(str(folder / file), load_external_data=False)
                for t in proto.graph.initializer:
                    if t.data_location != onnx.TensorProto.EXTERNAL:
                        continue
                    info = _external(t)
                    data = _read(folder, info, handles)
                    old_files.add(info["location"])
                    key = (t.data_type, tuple(t.dims), hashlib.sha256(data).hexdigest())
                    if key not in offsets:
                        offsets[key] = _append(out, data)
                    point(t, target, offsets[key], len(data))
                    referenced += 1
                protos[file] = proto
        finally:
            for f in handles.values():
                f.close()
        size = out.tell()
    if not offsets:
        (folder / target).unlink()
        return SharedWeights(None, 0, 0, 0, 0)
    old_files.discard(target)
    replaced = sum((folder / f).stat().st_size for f in old_files)
    for file, proto in protos.items():
        onnx.save_model(proto, str(folder / file))
    for f in old_files:
        (folder / f).unlink()
    return SharedWeights(target, size, len(offsets), referenced, replaced)


def share_with(folder: Path, model: str, graph_file: str, base: list[str]) -> dict[str, int]:
    """Point ``graph_file``'s external tensors that equal a tensor of the ``base`` graphs (dtype,
    shape and bytes) at the base's own offsets, and write the rest once to ``<model>.weights``:
    how a feature head reads the target's embedding and LM head without a second copy on disk.
    Returns the bytes written, the bytes read from the base's file, and how many tensors."""
    handles: dict[str, object] = {}
    proto = onnx.load(str(folder / graph_file), load_external_data=False)
    mine = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    shapes = {(t.data_type, tuple(t.dims)) for t in mine}
    found: dict[tuple, dict[str, str]] = {}  # (dtype, dims, sha256) -> the base tensor's external info
    target = f"{model}.weights"
    shared = referenced = 0
    try:
        for file in base:
            for t in onnx.load(str(folder / file), load_external_data=False).graph.initializer:
                if t.data_location == onnx.TensorProto.EXTERNAL and (t.data_type, tuple(t.dims)) in shapes:
                    info = _external(t)
                    found.setdefault((t.data_type, tuple(t.dims), hashlib.sha256(_read(folder, info, handles)).hexdigest()), info)
        old = {_external(t)["location"] for t in mine}
        offsets: dict[tuple, int] = {}
        with open(folder / target, "wb") as out:
            for t in mine:
                info = _external(t)
                data = _read(folder, info, handles)
                key = (t.data_type, tuple(t.dims), hashlib.sha256(data).hexdigest())
                if key in found:
                    point(t, found[key]["location"], int(found[key].get("offset", 0)), len(data))
                    referenced, shared = referenced + 1, shared + len(data)
                else:
                    if key not in offsets:
                        offsets[key] = _append(out, data)
                    point(t, target, offsets[key], len(data))
            size = out.tell()
    finally:
        for f in handles.values():
            f.close()
    onnx.save_model(proto, str(folder / graph_file))
    for f in old - {target}:
        (folder / f).unlink()
    return {"own_bytes": size, "shared_bytes": shared, "shared_tensors": referenced}
