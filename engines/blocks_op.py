"""specdec's block-quantized products for ONNX Runtime: the ``MatMulBlocks`` op of the ``ai.specdec``
domain, a C library built with the package (engines/csrc/; blocks.c says what it computes).

Each row's result is bit-identical whatever other rows share the call, so a verify call of γ + 1
rows gives each row what a 1-row call gives it. This module finds the library, registers it with a
session's options, and offers the product through ctypes for tests and benchmarks.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from pathlib import Path

import numpy as np

from specdec.errors import EngineError, InputError

DOMAIN, OP = "ai.specdec", "MatMulBlocks"
LIBRARY = "specdec.engines._kernels"  # the built library, as Python names it
WITHOUT = ("ONNX Runtime's MatMulNBits and GroupQueryAttention over the same blocks, the graphs rewritten once at load with the onnx "
           "package (engines/fallback.py, one warning): they run, but a verify call's rows are no longer row-invariant")
FORMATS = {"q8_0": 0, "q4_0": 1, "q4_1": 2}  # the op's ``format`` attribute
BLOCK = 32
ISAS = {"portable": 0, "avx2": 1, "avx512-vnni": 2}


@functools.cache
def library() -> Path | None:
    """The built library, or None where the install had no C compiler (or ``SPECDEC_KERNELS=off``)."""
    if os.environ.get("SPECDEC_KERNELS", "").lower() in ("0", "off", "no"):
        return None
    spec = importlib.util.find_spec(LIBRARY)
    return Path(spec.origin) if spec is not None and spec.origin else None


@functools.cache
def _lib() -> ctypes.CDLL | None:
    path = library()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    lib.sd_matmul.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                              ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]  # fmt: skip
    lib.sd_isa_available.argtypes = [ctypes.c_int]
    lib.specdec_kernel_isa.restype = ctypes.c_char_p
    return lib


def isa() -> str | None:
    """The instruction set the products run on here (``avx512-vnni``, ``avx2``, ``portable``), or None
    without the library."""
    lib = _lib()
    return lib.specdec_kernel_isa().decode() if lib is not None else None


def isas() -> list[str]:
    """Every instruction set this CPU can run the products on."""
    lib = _lib()
    return [name for name, i in ISAS.items() if lib is not None and lib.sd_isa_available(i)]


def register(options) -> bool:
    """Register the op library with ``options`` (an ``onnxruntime.SessionOptions``); False where it
    is missing."""
    path = library()
    if path is None:
        return False
    options.register_custom_ops_library(str(path))
    return True


def matmul(a: np.ndarray, blocks: np.ndarray, n: int, fmt: str, isa_name: str | None = None, gated: bool = False) -> np.ndarray:
    """a [M, K] float32 @ the blocks' [N, K] weights -> [M, N] float32, on one thread (the op splits
    the columns over ONNX Runtime's threads; the bits are the same). ``gated``: the blocks hold 2N
    columns (``gated_blocks``) and the result is silu(a @ gate) * (a @ up)."""
    lib = _lib()
    if lib is None:
        raise EngineError("specdec's block kernels are not built here; reinstall specdec with a C compiler present")
    a = np.ascontiguousarray(a, dtype=np.float32)
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    m, k = a.shape
    y = np.empty((m, n), np.float32)  # [M, N]
    isa_name = isa_name or isa()
    if gated and n % 16:
        raise InputError(f"a gated product of N={n} columns: N must be a multiple of 16 (the panels the two halves alternate in)")
    rc = lib.sd_matmul(FORMATS[fmt], ISAS[isa_name], int(gated), a.ctypes.data, m, k, blocks.ctypes.data, n, y.ctypes.data)
    if rc:
        raise InputError(f"sd_matmul refused {fmt} with M={m}, K={k}, N={n} on {isa_name} (code {rc}): K must be a multiple of "
                         f"{BLOCK} and the instruction set available here ({', '.join(isas())})")  # fmt: skip
    return y
