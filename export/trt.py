"""TensorRT engines (FP16) from the portable graphs. Needs ``tensorrt`` and an NVIDIA GPU.

Every portable graph has fully static shapes, so the optimisation profile pins each input
to its one shape (min = opt = max); the engine is serialized next to its ONNX source and
described in the manifest with the same inputs and outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from specdec.errors import EngineError
from specdec.manifest import GraphSpec, sha256_of


def build_engine(onnx_path: Path, plan_path: Path, spec: GraphSpec) -> None:
    """Parse ``onnx_path`` and write an FP16 engine with an explicit static profile to ``plan_path``."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for t in spec.inputs:
        if t.shape:  # scalars need no profile entry
            profile.set_shape(t.name, t.shape, t.shape, t.shape)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineError(f"TensorRT failed to build an engine from {onnx_path.name}; see the TensorRT log above")
    plan_path.write_bytes(bytes(plan))


def build_engines(folder: Path, portable: dict[str, GraphSpec], progress: Callable[[str], None]) -> dict[str, GraphSpec]:
    """An engine per portable graph, as manifest entries named ``<graph>_trt`` (flavour "tensorrt")."""
    out = {}
    for name, g in portable.items():
        progress(f"build TensorRT engine {name}")
        plan = Path(g.file).with_suffix(".plan").name
        build_engine(folder / g.file, folder / plan, g)
        out[name.replace("_portable", "_trt")] = GraphSpec(
            plan, sha256_of(folder / plan), g.model, g.role, g.tokens, g.inputs, g.outputs, (), "tensorrt"
        )
    return out
