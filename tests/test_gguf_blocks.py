"""A GGUF file's Q4_K and Q6_K blocks read as codes and float32 group scales
(speculant.runtime.gguf_blocks): the weights they give are bit for bit gguf-py's de-quantization,
on random blocks and on the real Q4_K_M file of the default target."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from speculant.errors import ModelLoadError
from speculant.runtime.gguf_blocks import Q4K_BYTES, Q5K_BYTES, Q6K_BYTES, dequantize_q4_k, dequantize_q5_k, \
    dequantize_q6_k, q4_k_parts, q5_k_blocks, q6_k_parts


def _random_blocks(rows: int, blocks: int, block_bytes: int, d_at: list[int], seed: int) -> np.ndarray:
    """Random bytes, with the fp16 scales at byte offsets ``d_at`` set to finite values."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks, block_bytes), dtype=np.uint8)
    for at in d_at:
        raw[..., at:at + 2] = rng.uniform(-0.05, 0.05, (rows, blocks)).astype("<f2")[..., None].view(np.uint8)
    return raw.reshape(rows, blocks * block_bytes)


def _same_bits(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert np.array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))


def test_q4_k_blocks_give_gguf_weights_bit_for_bit():
    raw = _random_blocks(5, 3, Q4K_BYTES, [0, 2], seed=1)
    codes, scale, offset = q4_k_parts(raw)
    assert codes.shape == (5, 768) and scale.shape == offset.shape == (5, 24)
    assert codes.dtype == np.uint8 and codes.max() <= 15
    _same_bits(dequantize_q4_k(raw), dequantize(raw, GGMLQuantizationType.Q4_K).reshape(5, 768))
    # a scale of its own per 32 weights: changing one sub-block's 6-bit scale changes those 32 only
    other = raw.copy()
    other[0, 4] ^= 1  # block 0, sub-block 0's scale, lowest bit
    changed = dequantize_q4_k(other)[0] != dequantize_q4_k(raw)[0]
    assert not changed[32:].any() and changed[:32].sum() == (codes[0, :32] != 0).sum()


def test_q5_k_blocks_give_gguf_weights_bit_for_bit():
    raw = _random_blocks(5, 3, Q5K_BYTES, [0, 2], seed=3)
    codes = q5_k_blocks(raw)[0]
    assert codes.shape == (5, 768) and codes.dtype == np.uint8 and codes.max() == 31 and codes.min() == 0
    _same_bits(dequantize_q5_k(raw), dequantize(raw, GGMLQuantizationType.Q5_K).reshape(5, 768))
    # the fifth bit of weight 32 j + l is bit j of byte 16 + l: flipping bit 0 of byte 16 moves weight 0 only
    other = raw.copy()
    other[0, 16] ^= 1
    changed = q5_k_blocks(other)[0][0] != codes[0]
    assert changed.nonzero()[0].tolist() == [0]


def test_q6_k_blocks_give_gguf_weights_bit_for_bit():
    raw = _random_blocks(4, 2, Q6K_BYTES, [208], seed=2)
    codes, scale = q6_k_parts(raw)
    assert codes.shape == (4, 512) and scale.shape == (4, 32) and codes.dtype == np.int8
    assert codes.min() >= -32 and codes.max() <= 31 and codes.min() < -16 < 16 < codes.max()
    _same_bits(dequantize_q6_k(raw), dequantize(raw, GGMLQuantizationType.Q6_K).reshape(4, 512))


def test_blocks_of_the_wrong_size_are_a_clear_error():
    with pytest.raises(ModelLoadError, match="whole 144-byte blocks"):
        q4_k_parts(np.zeros((2, 145), np.uint8))
    with pytest.raises(ModelLoadError, match="Q6_K"):
        q6_k_parts(np.zeros((2, 210), np.float32))


@pytest.mark.real
def test_the_default_targets_q4_k_m_file_reads_bit_for_bit():
    """Every Q4_K and Q6_K tensor of one layer, and the Q6_K output layer's first rows."""
    from gguf import GGUFReader

    from speculant.store.models import assemble_gguf
    from speculant.store.presets import PRESETS

    reader = GGUFReader(str(assemble_gguf(PRESETS["qwen2.5-coder-1.5b-instruct"])))
    read = {GGMLQuantizationType.Q4_K: dequantize_q4_k, GGMLQuantizationType.Q6_K: dequantize_q6_k}
    seen = set()
    for t in reader.tensors:
        if t.tensor_type not in read or not (t.name.startswith("blk.0.") or t.name == "output.weight"):
            continue
        raw = np.asarray(t.data)[:64]
        _same_bits(read[t.tensor_type](raw), dequantize(raw, t.tensor_type))
        assert raw.shape[1] // (Q4K_BYTES if t.tensor_type == GGMLQuantizationType.Q4_K else Q6K_BYTES) * 256 \
            == int(t.shape[0])  # K: GGUF lists a weight as [K, N]
        seen.add(t.tensor_type)
    assert seen == set(read)
