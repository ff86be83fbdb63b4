"""Opening an ONNX Runtime session for one bundle graph: the provider's name, options and
libraries, the checks of the bundle against the provider, and the graph's signature against the
manifest. The runners over a session's buffers are in engines/ort.py.
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from pathlib import Path

import onnxruntime as ort

from specdec.engines import blocks_op
from specdec.engines.binding import CUDA_ATTENTION_DTYPES
from specdec.engines.threads import ThreadPolicy
from specdec.errors import EngineError, SignatureError
from specdec.manifest import GraphSpec

ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "int64": "tensor(int64)", "int32": "tensor(int32)", "bool": "tensor(bool)"}
# A provider name -> ONNX Runtime's providers, with their options. CUDA: no TF32 (ORT's default
# is on), so that a float32 bundle computes in float32, as on the CPU.
# "cuda-graph": CUDA with graph capture (engines/captured.py): fixed-length calls replay a
# captured CUDA graph, every other call runs as on "cuda".
PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"],
    "cuda-graph": [("CUDAExecutionProvider", {"use_tf32": "0", "enable_cuda_graph": "1"}), "CPUExecutionProvider"],
}
DEVICE = {"cpu": "cpu", "cuda": "cuda", "cuda-graph": "cuda"}  # where a provider's KV buffers live
CAPTURE = {"cuda-graph"}  # providers whose fixed-length calls are captured
FLAVOURS = ("ort", "portable")  # the graph flavours ONNX Runtime runs: engines/ort.py's RUNNERS


def _shape_matches(want: tuple, got: list) -> bool:
    if len(want) != len(got):
        return False
    return all(isinstance(w, str) and not isinstance(g, int) or w == g for w, g in zip(want, got))


def check_signature(name: str, session: ort.InferenceSession, spec: GraphSpec) -> None:
    """Refuse a graph whose inputs/outputs differ from the manifest; say what differs."""
    problems = []
    for kind, want, have in (("input", spec.inputs, session.get_inputs()), ("output", spec.outputs, session.get_outputs())):
        got = {t.name: t for t in have}
        missing = sorted({t.name for t in want} - set(got))
        extra = sorted(set(got) - {t.name for t in want})
        if missing:
            problems.append(f"lacks {kind}s {missing}")
        if extra:
            problems.append(f"has unexpected {kind}s {extra}")
        for t in want:
            g = got.get(t.name)
            if g is None:
                continue
            if g.type != ORT_TYPES[t.dtype]:
                problems.append(f"{kind} {t.name} is {g.type}, manifest says {t.dtype}")
            if not _shape_matches(t.shape, g.shape):
                problems.append(f"{kind} {t.name} has shape {g.shape}, manifest says {list(t.shape)}")
    if problems:
        raise SignatureError(f"graph {name} ({spec.file}) differs from the manifest: {'; '.join(problems)}; re-export with specdec-export")


def open_session(
    bundle: Path, name: str, spec: GraphSpec, provider: str = "cpu", threads: ThreadPolicy | int | None = None
) -> ort.InferenceSession:
    """An ONNX Runtime session for one bundle graph, its signature checked against the manifest.

    Sessions are thread-safe and hold the weights; runners (buffers and bindings) are not,
    so several runners may share one session. ``threads``: a ``ThreadPolicy``, or an int for
    the default policy with that many threads.
    """
    first = require_provider(provider)
    if spec.flavour not in FLAVOURS:
        raise EngineError(f"graph {name} has flavour {spec.flavour!r}; ONNX Runtime runs {sorted(FLAVOURS)}")
    if spec.flavour == "portable" and DEVICE[provider] != "cpu":
        raise EngineError(f"graph {name} is a portable graph, which this engine runs on the CPU only; use provider='cpu' or the ort graphs")
    kv = next((t.dtype for t in spec.inputs if spec.io.past and t.name == spec.io.past[0][0]), None)
    if DEVICE[provider] == "cuda" and kv is not None and kv not in CUDA_ATTENTION_DTYPES:
        # one message per dtype, not per graph: Python shows it once for the whole bundle
        warnings.warn(f"a {kv} bundle on CUDA: GroupQueryAttention has no {kv} CUDA kernel, so attention runs on the CPU and the KV "
                      "crosses to the host every call; export with --dtype float16 for the GPU", RuntimeWarning, stacklevel=2)  # fmt: skip
    if provider in CAPTURE and DEVICE[provider] == "cuda" and kv is not None and kv not in CUDA_ATTENTION_DTYPES:
        raise EngineError(f"provider {provider!r} captures CUDA graphs, which need attention on the GPU: a {kv} bundle's runs on the CPU; "
                          "export with --dtype float16, or use provider='cuda'")  # fmt: skip
    if DEVICE[provider] == "cuda":
        _preload_cuda()
    options = ThreadPolicy.of(threads).session_options()
    if spec.role == "encoder" and spec.batch > 1:
        # a batched encoder's calls range from 1 source to max_batch padded ones; ORT's arena would keep the
        # largest call's activations for the session's life (about half the demo pair's weights + KV + cross K/V)
        options.enable_cpu_mem_arena = False
    # a rows graph's bodies sit in If nodes, which ORT does not capture: that session runs as on "cuda"
    providers = PROVIDERS["cuda" if provider in CAPTURE and spec.rows else provider]
    try:
        session = ort.InferenceSession(str(bundle / spec.file), options, providers=providers)
    except Exception as e:  # ONNX Runtime raises its own exception types
        if blocks_op.DOMAIN not in str(e) or blocks_op.library() is not None:
            raise
        from specdec.engines import fallback  # specdec's ops on ONNX Runtime's: the same weights, not row-invariant

        warnings.warn(fallback.WARNING, RuntimeWarning, stacklevel=2)
        session = ort.InferenceSession(str(fallback.nbits_graph(bundle, spec.file)), options, providers=providers)
    if first not in session.get_providers():  # ORT logs the failed load and goes on with the CPU alone
        raise EngineError(
            f"provider {provider!r}: ONNX Runtime could not start {first} for graph {name} (its log above names the missing library, "
            "e.g. cuBLAS or cuDNN); install the CUDA 13 libraries (pip install 'specdec[gpu]' brings them) or use provider='cpu'"
        )
    check_signature(name, session, spec)
    return session


def require_provider(provider: str) -> str:
    """``provider``'s main ONNX Runtime execution provider, or an EngineError when it is unknown or
    this onnxruntime lacks it (before any work: ``specdec check`` asks first)."""
    if provider not in PROVIDERS:
        raise EngineError(f"provider {provider!r} is not supported; use one of {sorted(PROVIDERS)}")
    first = provider_name(provider)
    if first not in ort.get_available_providers():
        raise EngineError(
            f"provider {provider!r} needs {first}, which this onnxruntime lacks; "
            "install onnxruntime-gpu (pip install 'specdec[gpu]') or use provider='cpu'"
        )
    return first


@functools.cache
def _preload_cuda() -> None:
    """Load the CUDA and cuDNN libraries from NVIDIA's pip wheels (what torch installs) before the
    CUDA provider looks for them: without it, on a machine whose CUDA comes only from pip, the
    provider fails to load (the H100 image did, unless torch was imported first)."""
    preload = getattr(ort, "preload_dlls", None)  # onnxruntime >= 1.21
    if preload is not None:  # it prints what it skips or misses; the session's own load error names the library that matters
        with contextlib.suppress(Exception), contextlib.redirect_stdout(io.StringIO()):
            preload()


def provider_name(provider: str) -> str:
    """ONNX Runtime's name of ``provider``'s first (main) execution provider."""
    first = PROVIDERS[provider][0]
    return first if isinstance(first, str) else first[0]
