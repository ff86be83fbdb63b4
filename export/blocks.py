"""Block quantization recipes, pure NumPy: llama.cpp's Q4_1 and Q8_0 blocks in MatMulNBits' layout.

A weight ``w`` [K, N] (``x @ w``) is cut into blocks of ``block`` along K, per column, as both
GGUF (a row of ``ne0 = K`` inputs) and ONNX Runtime's ``MatMulNBits`` (B: [N, K/block, blob])
do. Each recipe is the one llama.cpp uses to make that GGUF type:

- ``q4_1``: scale = (max - min) / 15, minimum = min; code = round((w - min) / scale) in 0..15;
- ``q4_0``: scale = m / -8 where m is the block's w of largest |w| (its sign kept); code =
  min(15, floor(w / scale + 8.5)), w ~= scale * (code - 8): MatMulNBits' symmetric 4-bit;
- ``q8_0``: scale = max|w| / 127; code = round(w / scale) in -127..127.

Both are idempotent: applied to weights a GGUF of that type dequantizes to, they give back
the file's own blocks (Q4_1: its minimum has code 0 and its maximum code 15, so min, max and
hence scale come back; Q4_0: its largest |w| has code 0, i.e. -8 x scale; Q8_0: its largest
|w| has code ±127). Requantizing a Q4_1 file's
weights with any other recipe (symmetric blocks, a rounded zero point) moves every weight onto
another grid: a second full 4-bit rounding, which on SmolLM2-135M loses the model
(docs/quantization.md). That is why int4 keeps Q4_1's float minimum.

MatMulNBits takes only integer zero points on its fast CPU path (a float zero point runs
~30x slower), so the minimum is split: w = scale * (code - z) + r with z = round(-min /
scale) in 0..15 and r = min + scale * z, |r| <= scale / 2. ``x @ w`` is then MatMulNBits over
(code, scale, z) plus the block sums of x times r: a [.., K/block] @ [K/block, N] float32
product (``export/quantize.py`` builds both).
"""

from __future__ import annotations

import numpy as np


def _blocks(w: np.ndarray, block: int) -> np.ndarray:
    """w [K, N] -> [N, K/block, block] float32 (K must be a multiple of block)."""
    k, n = w.shape
    if k % block:
        raise ValueError(f"K={k} is not a multiple of the block size {block}")
    return np.ascontiguousarray(w.T, dtype=np.float32).reshape(n, k // block, block)


def q4_1(w: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """codes [N, K/block, block] uint8 (0..15), scales [N, K/block] float32, minimums [N, K/block]
    float32, with w ~= scale * code + min per block."""
    b = _blocks(w, block)
    lo, hi = b.min(axis=-1), b.max(axis=-1)
    scale = (hi - lo) / 15
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    codes = np.clip(np.rint((b - lo[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    return codes, scale.astype(np.float32), lo.astype(np.float32)


def q4_0(w: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """codes [N, K/block, block] uint8 (0..15, zero point 8), scales [N, K/block] float32, with
    w ~= scale * (code - 8)."""
    b = _blocks(w, block)
    at = np.abs(b).argmax(axis=-1)[..., None]
    scale = np.take_along_axis(b, at, axis=-1)[..., 0] / -8
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)
    codes = np.clip(np.floor(b * inv[..., None] + 8.5), 0, 15).astype(np.uint8)
    return codes, scale.astype(np.float32)


def q8_0(w: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """codes [N, K/block, block] uint8 (stored + 128: MatMulNBits' 8-bit symmetric zero point),
    scales [N, K/block] float32, with w ~= scale * (code - 128)."""
    b = _blocks(w, block)
    scale = np.abs(b).max(axis=-1) / 127
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    codes = np.clip(np.rint(b * inv[..., None]), -127, 127).astype(np.int16) + 128
    return codes.astype(np.uint8), scale.astype(np.float32)


def split_minimum(scale: np.ndarray, minimum: np.ndarray, bits: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Integer zero points z [N, K/block] uint8 and residuals r [N, K/block] float32 with
    scale * (code - z) + r == scale * code + minimum."""
    top = 2**bits - 1
    z = np.clip(np.rint(-minimum / np.where(scale > 0, scale, 1)), 0, top)
    return z.astype(np.uint8), (minimum + scale * z).astype(np.float32)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Two 4-bit codes per byte, the even index in the low nibble, along the last axis. [.., n/2]"""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def pack_zero_points(z: np.ndarray) -> np.ndarray:
    """4-bit zero points [N, nb] -> MatMulNBits' [N, ceil(nb/2)] (odd nb padded with 8)."""
    if z.shape[1] % 2:
        z = np.concatenate([z, np.full((z.shape[0], 1), 8, np.uint8)], axis=1)
    return pack_nibbles(z)


def dequantize_q4_1(codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> np.ndarray:
    """Back to w [K, N] float32."""
    b = codes.astype(np.float32) * scale[..., None] + minimum[..., None]
    return b.reshape(b.shape[0], -1).T


def dequantize_q4_0(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Back to w [K, N] float32."""
    b = (codes.astype(np.float32) - 8) * scale[..., None]
    return b.reshape(b.shape[0], -1).T


def dequantize_q8_0(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Back to w [K, N] float32."""
    b = (codes.astype(np.float32) - 128) * scale[..., None]
    return b.reshape(b.shape[0], -1).T


PANEL = 16  # columns a MatMulBlocks panel holds (engines/csrc/blocks.c)


def _panels(x: np.ndarray) -> np.ndarray:
    """[N, ...] -> [ceil(N/16), 16, ...], zero columns padding the last panel."""
    pad = -x.shape[0] % PANEL
    x = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]) if pad else x
    return x.reshape(-1, PANEL, *x.shape[1:])


def column_blocks(w: np.ndarray, recipe: str, block: int = 32) -> np.ndarray:
    """w [K, N] -> specdec's ``MatMulBlocks`` weights [ceil(N/16), K/block * 16 * bytes] uint8: panels
    of 16 columns (the last padded with zero columns), each a run of panel blocks that hold the 16
    columns' float16 scales (Q4_1: then their float16 minimums), then their codes with four K
    positions of one column per 32-bit lane (engines/csrc/blocks.c):

        q8_0: d[16], u[8][16][4] with u = q + 128                   34 bytes a weight block
        q4_0: d[16], qs[4][16][4], code = nibble - 8                 18 bytes
        q4_1: d[16], m[16], qs[4][16][4], w = d * nibble + m         20 bytes

    A 4-bit lane's byte i of group c holds code 8c + i (low nibble) and 8c + 4 + i (high). The
    scales are rounded to float16 as llama.cpp stores them (exact for weights from a GGUF)."""
    if recipe == "q8_0":
        codes, scale = q8_0(w, block)  # codes: q + 128 already, [N, nb, 32]
        minimum = None
        lanes = codes.reshape(*codes.shape[:2], block // 4, 4)  # [N, nb, 8, 4]
    elif recipe in ("q4_0", "q4_1"):
        codes, scale, *rest = q4_1(w, block) if recipe == "q4_1" else q4_0(w, block)
        minimum = rest[0] if rest else None
        g = codes.reshape(*codes.shape[:2], block // 8, 2, 4)  # [N, nb, 4, lo|hi, 4]
        lanes = (g[..., 0, :] | (g[..., 1, :] << 4)).astype(np.uint8)  # [N, nb, 4, 4]
    else:
        raise ValueError(f"unknown block recipe {recipe!r}; expected q4_0, q4_1 or q8_0")
    halves = [scale] + ([minimum] if minimum is not None else [])
    heads = [_panels(h.astype(np.float16)).transpose(0, 2, 1).copy().view(np.uint8) for h in halves]  # [P, nb, 32] each
    body = _panels(lanes).transpose(0, 2, 3, 1, 4)  # [P, nb, groups, 16, 4]
    p, nb = body.shape[:2]
    out = np.concatenate([*heads, body.reshape(p, nb, -1)], axis=-1)  # [P, nb, 16 * bytes]
    return np.ascontiguousarray(out.reshape(p, -1))


def unpack_column_blocks(blob: np.ndarray, recipe: str, k: int, block: int = 32, n: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``column_blocks``' bytes -> (signed codes [N, nb, block] int16, scales [N, nb], minimums [N, nb])
    float32, with w = scale * code + minimum per block (Q8_0 and Q4_0: minimum 0, codes centred); N is
    the panels' 16 a panel unless ``n`` cuts the padding off."""
    nb = k // block
    heads = 2 if recipe == "q4_1" else 1
    per = blob.reshape(blob.shape[0], nb, -1)  # [P, nb, 16 * bytes]
    half = lambda i: per[..., 32 * i : 32 * (i + 1)].copy().view(np.float16).astype(np.float32).transpose(0, 2, 1).reshape(-1, nb)  # noqa: E731
    d = half(0)  # [N, nb]
    m = half(1) if heads == 2 else np.zeros_like(d)
    lanes = per[..., 32 * heads :].reshape(per.shape[0], nb, -1, PANEL, 4).transpose(0, 3, 1, 2, 4)  # [P, 16, nb, groups, 4]
    lanes = lanes.reshape(-1, nb, lanes.shape[3], 4)  # [N, nb, groups, 4]
    if recipe == "q8_0":
        codes = lanes.reshape(-1, nb, block).astype(np.int16) - 128
    else:
        codes = np.stack([lanes & 15, lanes >> 4], axis=3).reshape(-1, nb, block).astype(np.int16) - (8 if recipe == "q4_0" else 0)
    n = d.shape[0] if n is None else n
    return codes[:n], d[:n], m[:n]


def dequantize_column_blocks(blob: np.ndarray, recipe: str, k: int, block: int = 32, n: int | None = None) -> np.ndarray:
    """``column_blocks``' bytes -> w [K, N] float32."""
    codes, d, m = unpack_column_blocks(blob, recipe, k, block, n)
    w = d[..., None] * codes.astype(np.float32) + m[..., None]
    return w.reshape(w.shape[0], -1).T


def gated_blocks(blob: np.ndarray) -> np.ndarray:
    """``column_blocks`` of a gated MLP's [K, 2N] gate | up matrix (N a multiple of 16) -> the
    panels in turn, gate panel i then up panel i: ``MatMulBlocks`` with ``gated=1`` computes
    silu(x @ gate) * (x @ up) panel by panel."""
    halves = blob.reshape(2, blob.shape[0] // 2, blob.shape[1])  # [2, N/16, bytes]
    return np.ascontiguousarray(halves.transpose(1, 0, 2).reshape(blob.shape))


def ungated_blocks(blob: np.ndarray) -> np.ndarray:
    """``gated_blocks``' inverse: the gate's panels, then the up projection's."""
    pairs = blob.reshape(blob.shape[0] // 2, 2, blob.shape[1])  # [N/16, 2, bytes]
    return np.ascontiguousarray(pairs.transpose(1, 0, 2).reshape(blob.shape))
