"""The int4 matmul with a GGUF file's codes of more than 4 bits as they are: Q6_K
(kernels.pack_q6k_x86, ``int4_gemm_q6k``: codes 0..63 as a low-nibble plane and a 2-bit plane,
groups of 16, each scale d * sc and offset -32 * d * sc in fp32) and Q5_K (``pack_q5k_x86``,
``int4_gemm_q5k``: codes 0..31, a plane of fifth bits, Q4_K's scales): the packing round-trips; on
every code path the CPU has the product is the exact reference's, the same bits as the portable
path, and row-invariant; it is the product with gguf-py's de-quantized weights up to the int8
rounding of the activations, on random blocks and on the default target's Q6_K tensors (an
ffn_down and the output layer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speculant.kernels import INT4_ISAS, pack_q5k_x86, pack_q6k_x86, unpack_q5k_x86, unpack_q6k_x86, x86_kernels
from speculant.runtime.gguf_blocks import Q5K_BYTES, Q6K_BYTES, q5_k_blocks, q6_k_blocks

from test_kernels_x86 import exact_reference, isa_param

kernels = x86_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="needs an x86-64 CPU and a C++ toolchain")


def random_q6k(N: int, K: int, seed: int = 0) -> np.ndarray:
    """Random Q6_K blocks (N rows of K / 256 blocks) with a finite, weight-sized d."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N, K // 256, Q6K_BYTES), dtype=np.uint8)
    raw[..., 208:210] = rng.uniform(1e-5, 2e-4, (N, K // 256, 1)).astype("<f2").view(np.uint8)
    return raw.reshape(N, -1)


def random_q5k(N: int, K: int, seed: int = 0) -> np.ndarray:
    """Random Q5_K blocks (N rows of K / 256 blocks) with finite, weight-sized d and dmin."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N, K // 256, Q5K_BYTES), dtype=np.uint8)
    for at in (0, 2):
        raw[..., at:at + 2] = rng.uniform(5e-5, 1e-3, (N, K // 256, 1)).astype("<f2").view(np.uint8)
    return raw.reshape(N, -1)


def packed(raw: np.ndarray):
    """(codes u = q + 32 (N, K), the kernel's arguments, the exact reference's scale layout)."""
    q, d, sc = (torch.from_numpy(a.copy()) for a in q6_k_blocks(raw))
    qpack, qh, kd, km = pack_q6k_x86(q, d, sc)
    scale = d.repeat_interleave(16, 1) * sc.float()  # what the kernel makes of them, in fp32
    N, G = scale.shape
    sz = torch.stack([scale, -32 * scale]).reshape(2, N // 16, 16, G).permute(1, 3, 0, 2)
    return q.long() + 32, (qpack, qh, kd, km), sz


def packed5(raw: np.ndarray):
    """packed's for Q5_K: (codes (N, K), the kernel's arguments, the exact reference's scales)."""
    q, d, dmin, sc, m = (torch.from_numpy(a.copy()) for a in q5_k_blocks(raw))
    args = pack_q5k_x86(q, d, dmin, sc, m)
    scale, offset = d.repeat_interleave(8, 1) * sc.float(), (-dmin).repeat_interleave(8, 1) * m.float()
    N, G = scale.shape
    sz = torch.stack([scale, offset]).reshape(2, N // 16, 16, G).permute(1, 3, 0, 2)
    return q.long(), args, sz


# kind -> (random blocks, packed, the kernel's name, its group size)
KINDS = {"Q6_K": (random_q6k, packed, "int4_gemm_q6k", 16), "Q5_K": (random_q5k, packed5, "int4_gemm_q5k", 32)}


def test_q6k_and_q5k_packing_round_trips():
    raw = random_q6k(32, 512, seed=5)
    u, (qpack, qh, kd, km), _ = packed(raw)
    assert qpack.shape == (2, 64, 64) and qh.shape == (2, 32, 64) and kd.shape == (2, 2, 16) and km.shape == (2, 32, 16)
    assert km.dtype == torch.int8 and u.min() == 0 and u.max() == 63
    assert torch.equal(unpack_q6k_x86(qpack, qh).long() + 32, u)
    q, (qpack, qh, kd, km), _ = packed5(random_q5k(32, 512, seed=6))
    assert qh.shape == (2, 16, 64) and kd.shape == (2, 2, 2, 16) and km.shape == (2, 16, 2, 16)
    assert q.min() == 0 and q.max() == 31 and torch.equal(unpack_q5k_x86(qpack, qh).long(), q)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("isa", [isa_param(i) for i in INT4_ISAS])
def test_wide_kquant_matmul_is_the_exact_reference_on_every_path(isa, kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    random_blocks, pack, name, gsize = KINDS[kind]
    gemm = getattr(kernels, name)
    N, K = 48, 768
    raw = random_blocks(N, K)
    u, args, sz = pack(raw)
    x = torch.randn(19, K, generator=torch.Generator().manual_seed(1)).bfloat16()
    x[2, :gsize] = 0  # an all-zero group
    ref = exact_reference(x, u, sz, gsize)
    y = gemm(x, *args, torch.empty(0), True, INT4_ISAS[isa])
    assert y.shape == (19, N) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(y, gemm(x, *args, torch.empty(0), True, INT4_ISAS["portable"]))
    for m in (0, 5, 18):  # a row alone: bit for bit its row of the 19-row pass
        alone = gemm(x[m:m + 1].contiguous(), *args, torch.empty(0), True, INT4_ISAS[isa])
        assert torch.equal(alone[0], y[m])
    W = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(N, K)).double()
    exact = x.double() @ W.T  # the file's own weights: only the activations are rounded (int8 per group)
    assert ((y.double() - exact).norm() / exact.norm()) < 0.015
    bias = torch.randn(N)
    assert torch.equal(gemm(x, *args, bias, False, INT4_ISAS[isa]), (y + bias).bfloat16())


def test_wide_kquant_bad_arguments_are_clear_errors():
    _, (qpack, qh, kd, km), _ = packed(random_q6k(32, 256))
    x = torch.randn(2, 256).bfloat16()
    none = torch.empty(0)
    with pytest.raises(RuntimeError, match="qh must be"):
        kernels.int4_gemm_q6k(x, qpack, qh[:, :8].contiguous(), kd, km, none, True, 0)
    with pytest.raises(RuntimeError, match="km must be"):
        kernels.int4_gemm_q6k(x, qpack, qh, kd, km.to(torch.uint8), none, True, 0)
    with pytest.raises(RuntimeError, match="kd must be"):
        kernels.int4_gemm_q6k(x, qpack, qh, kd.double(), km, none, True, 0)
    with pytest.raises(RuntimeError, match="columns"):
        kernels.int4_gemm_q6k(torch.randn(2, 512).bfloat16(), qpack, qh, kd, km, none, True, 0)
    with pytest.raises(ValueError, match="K % 256 == 0"):
        pack_q6k_x86(torch.zeros(32, 128, dtype=torch.int8), torch.zeros(32, 1), torch.zeros(32, 8, dtype=torch.int8))
    _, (qpack, qh, kd, km), _ = packed5(random_q5k(32, 256))
    with pytest.raises(RuntimeError, match="qh must be"):
        kernels.int4_gemm_q5k(x, qpack, qh[:, :0].contiguous(), kd, km, none, True, 0)
    with pytest.raises(RuntimeError, match="km must be"):
        kernels.int4_gemm_q5k(x, qpack, qh, kd, km.float(), none, True, 0)


@pytest.mark.real
def test_the_default_targets_q6_k_tensors_run_as_they_are():
    """An MLP projection and the output layer of the Q4_K_M file (both Q6_K), read as they are and
    multiplied: the product with the file's own weights (gguf-py's), up to the int8 activations."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    from speculant.store.models import assemble_gguf
    from speculant.store.presets import PRESETS

    reader = GGUFReader(str(assemble_gguf(PRESETS["qwen2.5-coder-1.5b-instruct"])))
    tensors = {t.name: t for t in reader.tensors}
    six = [n for n, t in tensors.items() if t.tensor_type == GGMLQuantizationType.Q6_K and "ffn_down" in n][0]
    for name in (six, "output.weight"):
        t = tensors[name]
        assert t.tensor_type == GGMLQuantizationType.Q6_K, name
        raw = np.asarray(t.data)[:256]
        u, args, _ = packed(raw)
        x = torch.randn(3, u.shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
        y = kernels.int4_gemm_q6k(x, *args, torch.empty(0), True, 0)
        W = torch.from_numpy(dequantize(raw, t.tensor_type).reshape(u.shape)).double()
        exact = x.double() @ W.T
        assert ((y.double() - exact).norm() / exact.norm()) < 0.01, name
