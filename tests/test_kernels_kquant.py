"""The int4 matmul with a GGUF file's Q4_K scales as they are (kernels.pack_kquant_x86,
``int4_gemm_kquant``: groups of 32, each scale d * sc and offset -dmin * m in fp32): on every
code path the CPU has it is the exact reference's product, the same bits as the portable path,
and row-invariant; on Q4_K blocks (random, and the default target's file) it is the product with
gguf-py's de-quantized weights up to the int8 rounding of the activations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speculant.kernels import INT4_ISAS, pack_kquant_x86, x86_kernels
from speculant.runtime.gguf_blocks import Q4K_BYTES, q4_k_blocks

from test_kernels_x86 import exact_reference, isa_param

kernels = x86_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="needs an x86-64 CPU and a C++ toolchain")
ISAS = list(INT4_ISAS)


def random_q4k(N: int, K: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K blocks (N rows of K / 256 blocks) with finite, weight-sized d and dmin."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N, K // 256, Q4K_BYTES), dtype=np.uint8)
    raw[..., 0:2] = rng.uniform(1e-4, 2e-3, (N, K // 256, 1)).astype("<f2").view(np.uint8)
    raw[..., 2:4] = rng.uniform(1e-4, 2e-3, (N, K // 256, 1)).astype("<f2").view(np.uint8)
    return raw.reshape(N, -1)


def packed(raw: np.ndarray):
    q, d, dmin, sc, m = (torch.from_numpy(a.copy()) for a in q4_k_blocks(raw))
    qpack, kd, km = pack_kquant_x86(q, d, dmin, sc, m)
    scale = d.repeat_interleave(8, 1) * sc.float()  # what the kernel makes of them, in fp32
    offset = (-dmin).repeat_interleave(8, 1) * m.float()
    N, G = scale.shape
    sz = torch.stack([scale, offset]).reshape(2, N // 16, 16, G).permute(1, 3, 0, 2)  # exact_reference's layout
    return q, qpack, kd, km, sz


@pytest.mark.parametrize("isa", [isa_param(i) for i in ISAS])
def test_kquant_matmul_is_the_exact_reference_on_every_path(isa):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    N, K = 48, 768
    raw = random_q4k(N, K)
    q, qpack, kd, km, sz = packed(raw)
    x = torch.randn(19, K, generator=torch.Generator().manual_seed(1)).bfloat16()
    x[2, :32] = 0  # an all-zero group
    ref = exact_reference(x, q, sz, 32)
    y = kernels.int4_gemm_kquant(x, qpack, kd, km, torch.empty(0), True, INT4_ISAS[isa])
    assert y.shape == (19, N) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(y, kernels.int4_gemm_kquant(x, qpack, kd, km, torch.empty(0), True, INT4_ISAS["portable"]))
    for m in (0, 5, 18):  # a row alone: bit for bit its row of the 19-row pass
        alone = kernels.int4_gemm_kquant(x[m:m + 1].contiguous(), qpack, kd, km, torch.empty(0), True, INT4_ISAS[isa])
        assert torch.equal(alone[0], y[m])
    W = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K).reshape(N, K)).double()
    exact = x.double() @ W.T  # the file's own weights: only the activations are rounded (int8 per group)
    assert ((y.double() - exact).norm() / exact.norm()) < 0.015
    bias = torch.randn(N)
    with_bias = kernels.int4_gemm_kquant(x, qpack, kd, km, bias, False, INT4_ISAS[isa])
    assert torch.equal(with_bias, (y + bias).bfloat16())


def test_kquant_bad_arguments_are_clear_errors():
    q, qpack, kd, km, _ = packed(random_q4k(32, 256))
    x = torch.randn(2, 256).bfloat16()
    with pytest.raises(RuntimeError, match="kd must be"):
        kernels.int4_gemm_kquant(x, qpack, kd[:, :, :1].contiguous(), km, torch.empty(0), True, 0)
    with pytest.raises(RuntimeError, match="km must be"):
        kernels.int4_gemm_kquant(x, qpack, kd, km.float(), torch.empty(0), True, 0)
    with pytest.raises(RuntimeError, match="columns"):
        kernels.int4_gemm_kquant(torch.randn(2, 512).bfloat16(), qpack, kd, km, torch.empty(0), True, 0)
    with pytest.raises(ValueError, match="K % 256 == 0"):
        pack_kquant_x86(q[:, :128], kd.new_zeros(32, 1), kd.new_zeros(32, 1), km.new_zeros(32, 4), km.new_zeros(32, 4))


@pytest.mark.real
def test_the_default_targets_q4_k_tensors_run_as_they_are():
    """An attention and an MLP projection of the Q4_K_M file, read as they are and multiplied:
    the product with the file's own weights (gguf-py's), up to the activations' int8 rounding."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from speculant.store.models import assemble_gguf
    from speculant.store.presets import PRESETS

    reader = GGUFReader(str(assemble_gguf(PRESETS["qwen2.5-coder-1.5b-instruct"])))
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight"):
        t = tensors[name]
        raw = np.asarray(t.data)[:256]
        q, qpack, kd, km, _ = packed(raw)
        x = torch.randn(3, q.shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
        y = kernels.int4_gemm_kquant(x, qpack, kd, km, torch.empty(0), True, 0)
        W = torch.from_numpy(dequantize(raw, t.tensor_type).reshape(q.shape)).double()
        exact = x.double() @ W.T
        assert ((y.double() - exact).norm() / exact.norm()) < 0.015, name
