"""An ONNX Runtime I/O binding that stays right when the buffers it binds change between runs.

ORT copies a bound input to the device whose node reads it when it is *bound*
(``IOBinding::BindInput`` calls ``CopyOneInputAcrossDevices``), not when the graph runs. On
the CPU provider a host buffer is read in place, so an engine binds its buffers once and
only writes them between runs. On CUDA the graph would read the copy made at bind time: the
first GPU run decoded from stale token ids (docs/gpu.md). So where the KV lives on a device,
the inputs whose memory differs from where they are read are bound again before every run:
the host buffers (ids, positions, lengths: a few bytes, copied then), and, where attention
runs on the CPU provider (a float32 graph: GroupQueryAttention has no float32 CUDA kernel),
the device KV buffers too.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

# GroupQueryAttention's CUDA kernels take float16 / bfloat16 only: a float32 graph's attention
# runs on the CPU provider, and its KV crosses to the host and back every call.
CUDA_ATTENTION_DTYPES = ("float16",)


def stale_memories(device: str, kv_dtype) -> frozenset[str]:
    """The memories whose bound inputs a graph over a ``device`` cache of ``kv_dtype`` must
    bind again before each run (see the module docstring); none on the CPU."""
    if device == "cpu":
        return frozenset()
    if device == "cuda" and np.dtype(kv_dtype).name not in CUDA_ATTENTION_DTYPES:
        return frozenset({"cpu", "cuda"})
    return frozenset({"cpu"})  # "ortvalue" (host OrtValues) takes this path too, so CPU tests run it


class Binding:
    """``session.io_binding()`` that remembers its inputs and binds those in ``stale`` memories
    again before each ``run``. Outputs are written at run time wherever they are bound."""

    def __init__(self, session: ort.InferenceSession, stale: frozenset[str] = frozenset()):
        self.session, self.io, self.stale = session, session.io_binding(), stale
        self.inputs: dict[str, tuple] = {}  # name -> bind_input's arguments, where stale
        self.options = plain_run(session)

    def bind_input(self, name: str, memory: str, device_id: int, dtype, shape: list[int], ptr: int) -> None:
        if memory in self.stale:
            self.inputs[name] = (memory, device_id, dtype, shape, ptr)
        else:
            self.inputs.pop(name, None)
        self.io.bind_input(name, memory, device_id, dtype, shape, ptr)

    def bind_output(self, name: str, memory: str, device_id: int, dtype, shape: list[int], ptr: int) -> None:
        self.io.bind_output(name, memory, device_id, dtype, shape, ptr)

    def run(self) -> None:
        for name, args in self.inputs.items():
            self.io.bind_input(name, *args)
        self.session.run_with_iobinding(self.io, self.options)


def captures(session: ort.InferenceSession) -> bool:
    """Whether ``session``'s CUDA provider captures CUDA graphs (provider "cuda-graph")."""
    return session.get_provider_options().get("CUDAExecutionProvider", {}).get("enable_cuda_graph") == "1"


def plain_run(session: ort.InferenceSession) -> ort.RunOptions | None:
    """Run options for a run that is not captured: on a capturing session, graph id -1 (ORT
    would otherwise capture the run under id 0 and replay it, whatever the next run's shapes)."""
    if not captures(session):
        return None
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", "-1")
    return options
