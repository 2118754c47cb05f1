"""A GGUF file's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights run as they are (runtime.gguf_blocks.legacy_blocks,
kernels.int4_gemm_f32, runtime.block_quant.BlockQuantLinear): the blocks read give gguf-py's
weights; the fp32-scale matmul is the exact reference's product on every code path the CPU has, the
same bits as the portable path, and row-invariant; a Q8_0 layer (two planes) gives the same bits on
every path. (The layers themselves, beside the k-quant ones: tests/test_gguf_linears.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speculant.errors import ModelLoadError
from speculant.kernels import INT4_ISAS, pack_f32scales_x86, unpack_int4_x86, unpack_q5k_x86, x86_kernels
from speculant.runtime.gguf_blocks import LEGACY, dequantize_legacy, legacy_blocks

from test_kernels_x86 import exact_reference, isa_param

kernels = x86_kernels()
KINDS = list(LEGACY)


def random_legacy(kind: str, N: int, K: int, seed: int = 0) -> np.ndarray:
    """Random ``kind`` blocks (N rows of K / 32 blocks) with finite, weight-sized d (and m)."""
    size, _, zero = LEGACY[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N, K // 32, size), dtype=np.uint8)
    raw[..., 0:2] = rng.uniform(-2e-3, 2e-3, (N, K // 32, 1)).astype("<f2").view(np.uint8)
    if zero is None:
        raw[..., 2:4] = rng.uniform(-2e-2, 2e-2, (N, K // 32, 1)).astype("<f2").view(np.uint8)
    return raw.reshape(N, -1)


@pytest.mark.parametrize("kind", KINDS)
def test_legacy_blocks_give_gguf_weights(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_legacy(kind, 32, 512, seed=1)
    codes, scale, offset = legacy_blocks(raw, kind)
    assert codes.shape == (32, 512) and scale.shape == offset.shape == (32, 16)
    assert int(codes.max()) < 2 ** LEGACY[kind][1]
    theirs = dequantize(raw, GGMLQuantizationType[kind]).reshape(32, 512)
    assert np.array_equal(dequantize_legacy(raw, kind), theirs)  # every weight (a zero's sign aside)


def test_legacy_blocks_of_the_wrong_size_are_a_clear_error():
    with pytest.raises(ModelLoadError, match="34-byte blocks"):
        legacy_blocks(np.zeros((4, 33), dtype=np.uint8), "Q8_0")
    with pytest.raises(ValueError, match="not Q2_K"):
        legacy_blocks(np.zeros((4, 84), dtype=np.uint8), "Q2_K")


def _exact(x, codes, scale, offset):
    """exact_reference with fp32 (scale, offset) pairs, groups of 32."""
    N, G = scale.shape
    sz = torch.stack([scale, offset]).reshape(2, N // 16, 16, G).permute(1, 3, 0, 2)
    return exact_reference(x, codes, sz, 32)


@pytest.mark.skipif(kernels is None, reason="needs an x86-64 CPU and a C++ toolchain")
@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("isa", [isa_param(i) for i in INT4_ISAS])
def test_f32_scale_matmul_is_the_exact_reference_on_every_path(isa, bits):
    kind = "Q4_1" if bits == 4 else "Q5_0"
    N, K = 48, 512
    codes, scale, offset = (torch.from_numpy(a.copy()) for a in legacy_blocks(random_legacy(kind, N, K), kind))
    qpack, sf, qh = pack_f32scales_x86(codes, scale, offset, bits)
    assert (qh.numel() > 0) == (bits == 5)
    unpacked = unpack_q5k_x86(qpack, qh) if bits == 5 else unpack_int4_x86(qpack)
    assert torch.equal(unpacked, codes)
    x = torch.randn(19, K, generator=torch.Generator().manual_seed(2)).bfloat16()
    x[3, 64:96] = 0  # an all-zero group
    y = kernels.int4_gemm_f32(x, qpack, sf, qh, torch.empty(0), True, INT4_ISAS[isa])
    torch.testing.assert_close(y.double(), _exact(x, codes, scale, offset), rtol=1e-5, atol=1e-5)
    assert torch.equal(y, kernels.int4_gemm_f32(x, qpack, sf, qh, torch.empty(0), True, INT4_ISAS["portable"]))
    for m in (0, 7, 18):  # a row alone: bit for bit its row of the 19-row pass
        alone = kernels.int4_gemm_f32(x[m:m + 1].contiguous(), qpack, sf, qh, torch.empty(0), True, INT4_ISAS[isa])
        assert torch.equal(alone[0], y[m])
    bias = torch.randn(N)
    assert torch.equal(kernels.int4_gemm_f32(x, qpack, sf, qh, bias, False, INT4_ISAS[isa]), (y + bias).bfloat16())


@pytest.mark.skipif(kernels is None, reason="needs an x86-64 CPU and a C++ toolchain")
def test_f32_scale_bad_arguments_are_clear_errors():
    codes, scale, offset = (torch.from_numpy(a.copy()) for a in legacy_blocks(random_legacy("Q5_1", 16, 256), "Q5_1"))
    qpack, sf, qh = pack_f32scales_x86(codes, scale, offset, 5)
    x = torch.randn(2, 256).bfloat16()
    with pytest.raises(RuntimeError, match="sf must be"):
        kernels.int4_gemm_f32(x, qpack, sf.bfloat16(), qh, torch.empty(0), True, 0)
    with pytest.raises(RuntimeError, match="qh must be"):
        kernels.int4_gemm_f32(x, qpack, sf, qh[:, :4].contiguous(), torch.empty(0), True, 0)
    with pytest.raises(RuntimeError, match="columns"):
        kernels.int4_gemm_f32(torch.randn(2, 512).bfloat16(), qpack, sf, qh, torch.empty(0), True, 0)
    with pytest.raises(ValueError, match="5-bit codes in groups of 32"):
        pack_f32scales_x86(codes[:, :128], scale[:, :2], offset[:, :2], 5)


@pytest.mark.skipif(kernels is None, reason="needs an x86-64 CPU and a C++ toolchain")
@pytest.mark.parametrize("isa", [isa_param(i) for i in INT4_ISAS])
def test_a_q8_0_layer_gives_the_same_bits_on_every_path(isa):
    from speculant.runtime.block_quant import BlockQuantLinear

    layer = BlockQuantLinear.from_blocks(random_legacy("Q8_0", 32, 256, seed=5), torch.randn(32), kind="Q8_0")
    x = torch.randn(6, 256).bfloat16()
    layer._isa = "portable"
    portable = layer.forward_float(x)
    layer._isa = isa
    assert torch.equal(layer.forward_float(x), portable)
