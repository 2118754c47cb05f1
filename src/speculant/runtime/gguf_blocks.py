"""A GGUF file's k-quant blocks as integer codes and float32 group scales, unchanged.

What the int4 runtime needs to run a user's Q4_K_M file as it is, instead of de-quantizing it and
quantizing again: every weight as ``code * scale + offset`` with the file's own codes and the
file's own scales (float32, exact: a block's fp16 ``d`` times a 6-bit sub-scale needs 17
significant bits, more than bf16 keeps). The layouts are ggml's (``ggml-common.h``, ``block_q4_K``
and ``block_q6_K``, 256 weights per block); the weights these give are bit for bit those of
``gguf.quants.dequantize`` (tests/test_gguf_blocks.py).

* **Q4_K** (144 bytes): fp16 ``d``, fp16 ``dmin``, 12 bytes packing eight 6-bit scales and eight
  6-bit mins, 128 bytes of 4-bit codes. Sub-block ``j`` (32 weights) is
  ``w = (d * sc_j) * q - (dmin * m_j)``: groups of 32 with ``scale = d * sc_j`` and ``offset = -dmin * m_j``.
* **Q5_K** (176 bytes): Q4_K's d, dmin and 12 scale bytes, then 32 bytes of fifth bits and 128 bytes
  of low 4 bits: Q4_K's groups and scales with codes 0..31 (weight 32 j + l of a block takes bit j of
  the fifth-bit byte l).
* **Q6_K** (210 bytes): 128 bytes of low 4 bits, 64 bytes of high 2 bits, sixteen int8 scales,
  fp16 ``d``. Weight ``i`` is ``w = (d * sc_{i // 16}) * (q - 32)``: groups of 16, codes in -32..31.

The older block types, 32 weights per block, each with an fp16 scale ``d`` (``block_q4_0`` ...
``block_q8_0``), are read by :func:`legacy_blocks` as codes, scale and offset per group of 32:

* **Q4_0** (18 bytes): ``d``, 16 bytes of 4-bit codes (weight j in the low nibble of byte j, weight
  16 + j in its high nibble): ``w = d * (q - 8)``.
* **Q4_1** (20 bytes): ``d``, fp16 ``m``, Q4_0's codes: ``w = d * q + m``.
* **Q5_0** (22 bytes): ``d``, 4 bytes of fifth bits (bit j of the little-endian word for weight j),
  Q4_0's low bits: ``w = d * (q - 16)``.
* **Q5_1** (24 bytes): ``d``, ``m``, Q5_0's fifth bits and low bits: ``w = d * q + m``.
* **Q8_0** (34 bytes): ``d``, 32 int8 codes: ``w = d * q``.

Shapes: a tensor of ``N`` rows of ``K`` weights (GGUF lists them as ``[K, N]``) is read as its raw
bytes ``(N, K / block_weights * block_bytes)`` uint8, the layout ``GGUFReader`` gives.
"""

from __future__ import annotations

import numpy as np

from ..errors import ModelLoadError

__all__ = ["BLOCK", "LEGACY", "dequantize_legacy", "legacy_blocks", "Q4K_BYTES", "Q5K_BYTES", "Q6K_BYTES",
           "dequantize_q4_k", "dequantize_q5_k", "dequantize_q6_k",
           "q4_k_blocks", "q4_k_parts", "q5_k_blocks", "q6_k_blocks", "q6_k_parts"]

BLOCK = 256  # weights per k-quant block (QK_K)
Q4K_BYTES, Q5K_BYTES, Q6K_BYTES = 144, 176, 210


def _blocks(raw: np.ndarray, block_bytes: int, name: str) -> np.ndarray:
    """``raw`` (N, bytes) uint8 as (N, K / 256, block_bytes), or a clear error."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % block_bytes:
        raise ModelLoadError(f"a {name} tensor must be rows of whole {block_bytes}-byte blocks (uint8, 2-D); got "
                             f"{raw.dtype} of shape {raw.shape}: the GGUF file is damaged or not what it says")
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _fp16(two_bytes: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 little-endian fp16 -> (...) float32."""
    return np.ascontiguousarray(two_bytes).view("<f2")[..., 0].astype(np.float32)


def _q4k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of each block (..., 12) -> eight 6-bit scales and eight 6-bit mins (..., 8)
    as int: sub-blocks 0-3 hold theirs in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins);
    sub-blocks 4-7 in the nibbles of bytes 8-11 (low: scale, high: min) and, as their top two bits,
    the high 2 bits of bytes 0-3 (scales) and 4-7 (mins)."""
    s = packed.astype(np.int32)
    lo_sc, lo_m, nib = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo_sc & 63, (nib & 15) | ((lo_sc >> 6) << 4)], axis=-1)
    mins = np.concatenate([lo_m & 63, (nib >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc, mins


def q4_k_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K tensor's raw bytes (N, K / 256 * 144) -> its parts as they are: codes (N, K) uint8
    in 0..15, each block's ``d`` and ``dmin`` (N, K / 256) float32 (from fp16), each group's 6-bit
    scale and min (N, K / 32) uint8 (``kernels.pack_kquant_x86`` takes these)."""
    b = _blocks(raw, Q4K_BYTES, "Q4_K")
    return _q4k_layout(b, b[..., 16:], 0)


def q5_k_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A Q5_K tensor's raw bytes (N, K / 256 * 176) -> its parts as they are, as
    :func:`q4_k_blocks` gives a Q4_K tensor's but with codes (N, K) uint8 in 0..31."""
    b = _blocks(raw, Q5K_BYTES, "Q5_K")
    qh = b[..., 16:48]  # (N, nb, 32): bit j of byte l is the fifth bit of weight 32 j + l
    return _q4k_layout(b, b[..., 48:], np.stack([(qh >> j) & 1 for j in range(8)], axis=2))


def _q4k_layout(b: np.ndarray, qs: np.ndarray, fifth) -> tuple[np.ndarray, ...]:
    """The parts of blocks ``b`` (N, nb, bytes) laid out as Q4_K's: fp16 d and dmin, then 12 bytes
    of scales and mins; ``qs`` (N, nb, 128) their low 4 bits, four runs of 32 bytes (sub-blocks 2p
    in the low nibbles, 2p + 1 in the high); ``fifth`` (N, nb, 8, 32) their fifth bits, or 0."""
    N, nb = b.shape[:2]
    d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])  # (N, nb)
    sc, mins = _q4k_scales_mins(b[..., 4:16])  # (N, nb, 8)
    qs = qs.reshape(N, nb, 4, 32)
    low = np.stack([qs & 15, qs >> 4], axis=3).reshape(N, nb, 8, 32)
    codes = (low | (np.asarray(fifth, dtype=np.uint8) << 4)).reshape(N, nb * BLOCK)
    return (codes.astype(np.uint8), d, dmin, sc.reshape(N, nb * 8).astype(np.uint8),
            mins.reshape(N, nb * 8).astype(np.uint8))


def _scale_offset(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each group of 32's scale d * sc and offset -dmin * m (N, K / 32) float32, of Q4_K's and Q5_K's parts."""
    return np.repeat(d, 8, axis=1) * sc.astype(np.float32), -(np.repeat(dmin, 8, axis=1) * mins.astype(np.float32))


def q4_k_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K tensor's raw bytes (N, K / 256 * 144) -> (codes (N, K) uint8 in 0..15,
    scale (N, K / 32) float32, offset (N, K / 32) float32): ``w = code * scale + offset`` per
    group of 32 inputs."""
    codes, *rest = q4_k_blocks(raw)
    return (codes, *_scale_offset(*rest))


def q6_k_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q6_K tensor's raw bytes (N, K / 256 * 210) -> its parts as they are: codes (N, K) int8 in
    -32..31, each block's ``d`` (N, K / 256) float32 (from fp16), each group's scale (N, K / 16)
    int8 (``kernels.pack_q6k_x86`` takes these): ``w = (d * scale) * code`` per group of 16 inputs."""
    b = _blocks(raw, Q6K_BYTES, "Q6_K")
    N, nb = b.shape[:2]
    ql = b[..., 0:128].reshape(N, nb, 2, 64)  # per half of 128 weights: 64 bytes of low bits
    qh = b[..., 128:192].reshape(N, nb, 2, 32)  # and 32 bytes of high bits
    # within a half, weight 32 r + l (r = 0..3) takes the low nibble (r = 0, 1) or high nibble (r = 2, 3)
    # of ql[l + 32 (r % 2)] and bits 2r, 2r + 1 of qh[l]
    low = np.stack([ql[..., 0:32] & 15, ql[..., 32:64] & 15, ql[..., 0:32] >> 4, ql[..., 32:64] >> 4], axis=3)
    high = np.stack([(qh >> (2 * r)) & 3 for r in range(4)], axis=3)
    codes = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32
    return (codes.reshape(N, nb * BLOCK).astype(np.int8), _fp16(b[..., 208:210]),
            np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(N, nb * 16))


def q6_k_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q6_K tensor's raw bytes (N, K / 256 * 210) -> (codes (N, K) int8 in -32..31,
    scale (N, K / 16) float32): ``w = code * scale`` per group of 16 inputs."""
    codes, d, sc = q6_k_blocks(raw)
    scale = np.repeat(d, 16, axis=1) * sc.astype(np.float32)
    return codes, scale


def dequantize_q4_k(raw: np.ndarray) -> np.ndarray:
    """The float32 weights (N, K) of a Q4_K tensor, from :func:`q4_k_parts`."""
    return _groups_of_32(*q4_k_parts(raw))


def dequantize_q5_k(raw: np.ndarray) -> np.ndarray:
    """The float32 weights (N, K) of a Q5_K tensor: ``w = code * (d * sc) - dmin * m`` per group of 32."""
    codes, *rest = q5_k_blocks(raw)
    return _groups_of_32(codes, *_scale_offset(*rest))


def _groups_of_32(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """``code * scale + offset`` (N, K) float32, one scale and offset per group of 32 inputs."""
    N, K = codes.shape
    w = codes.reshape(N, -1, 32).astype(np.float32) * scale[..., None] + offset[..., None]
    return w.reshape(N, K)


def dequantize_q6_k(raw: np.ndarray) -> np.ndarray:
    """The float32 weights (N, K) of a Q6_K tensor, from :func:`q6_k_parts`."""
    codes, scale = q6_k_parts(raw)
    N, K = codes.shape
    return (codes.reshape(N, -1, 16).astype(np.float32) * scale[..., None]).reshape(N, K)


# the 32-weight block types: bytes per block, code bits, and the code's zero point (None: an fp16
# min follows d, w = d * q + m)
LEGACY = {"Q4_0": (18, 4, 8), "Q4_1": (20, 4, None), "Q5_0": (22, 5, 16), "Q5_1": (24, 5, None), "Q8_0": (34, 8, 128)}


def legacy_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A ``kind`` (Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0) tensor's raw bytes (N, K / 32 * block bytes) ->
    (codes (N, K) uint8 in 0 .. 2^bits - 1, scale (N, K / 32) float32, offset (N, K / 32) float32):
    ``w = code * scale + offset`` per group of 32 inputs, the file's weights bit for bit. Codes are
    unsigned: a signed Q8_0 code q is q + 128 here, with offset -128 d (Q4_0: offset -8 d; Q5_0:
    -16 d; Q4_1 and Q5_1: the block's m), each exact in float32."""
    if kind not in LEGACY:
        raise ValueError(f"legacy_blocks reads {', '.join(LEGACY)}, not {kind}")
    size, bits, zero = LEGACY[kind]
    b = _blocks(raw, size, kind)
    N, nb = b.shape[:2]
    d = _fp16(b[..., 0:2])  # (N, nb)
    at = 2 if zero is not None else 4
    offset = -d * np.float32(zero) if zero is not None else _fp16(b[..., 2:4])
    if bits == 8:
        codes = (b[..., at:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    else:
        fifth = 0
        if bits == 5:
            word = np.ascontiguousarray(b[..., at:at + 4]).view("<u4")  # (N, nb, 1)
            fifth = ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # (N, nb, 32)
            at += 4
        qs = b[..., at:at + 16]
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1) | (fifth << 4)
    return codes.reshape(N, nb * 32).astype(np.uint8), d, offset.astype(np.float32)


def dequantize_legacy(raw: np.ndarray, kind: str) -> np.ndarray:
    """The float32 weights (N, K) of a Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 tensor."""
    return _groups_of_32(*legacy_blocks(raw, kind))
