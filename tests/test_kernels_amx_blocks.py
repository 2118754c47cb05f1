"""The AMX path of the int4 matmul on a GGUF file's own blocks (int4_amx_x86.cpp with groups of 16
and 32 inputs, high bits OR-ed in, k-quant and fp32 scales; passes of 32 rows or more): bit for bit
the portable path's product at every width it takes (whole and ragged 16-row tiles), in fp32 and bf16
with a bias, including the largest integer sums a group can reach; so a verified tree's rows keep
the bits of one-row passes on AMX CPUs too."""

from __future__ import annotations

import pytest
import torch

from speculant.kernels import INT4_ISAS, pack_f32scales_x86, pack_kquant_x86, pack_q5k_x86, pack_q6k_x86, x86_kernels
from speculant.runtime.gguf_blocks import q4_k_blocks, q5_k_blocks, q6_k_blocks

from test_kernels_kquant import random_q4k
from test_kernels_kquant_wide import random_q5k, random_q6k
from test_kernels_x86 import isa_param

kernels = x86_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="needs an x86-64 CPU and a C++ toolchain")

N, K = 64, 768


def blocks(parts) -> list[torch.Tensor]:
    return [torch.from_numpy(a.copy()) for a in parts]


# Each kind's kernel and arguments: random codes, or (top) every code at its largest, the largest sums.
def q4k_args(top: bool):
    q, d, dmin, sc, m = blocks(q4_k_blocks(random_q4k(N, K, seed=11)))
    return kernels.int4_gemm_kquant, pack_kquant_x86(torch.full_like(q, 15) if top else q, d, dmin, sc, m)


def q5k_args(top: bool):
    q, d, dmin, sc, m = blocks(q5_k_blocks(random_q5k(N, K, seed=12)))
    return kernels.int4_gemm_q5k, pack_q5k_x86(torch.full_like(q, 31) if top else q, d, dmin, sc, m)


def q6k_args(top: bool):
    q, d, sc = blocks(q6_k_blocks(random_q6k(N, K, seed=13)))  # q in -32 .. 31
    return kernels.int4_gemm_q6k, pack_q6k_x86(torch.full_like(q, 31) if top else q, d, sc)


def f32_args(bits: int):
    def make(top: bool):
        g = torch.Generator().manual_seed(14 + bits)
        q = torch.full((N, K), 2 ** bits - 1) if top else torch.randint(0, 2 ** bits, (N, K), generator=g)
        scale = torch.rand(N, K // 32, generator=g) * 1e-2
        offset = -torch.rand(N, K // 32, generator=g) * 1e-1
        qpack, sf, qh = pack_f32scales_x86(q, scale, offset, bits)
        return kernels.int4_gemm_f32, (qpack, sf, qh)
    return make


KINDS = {"Q4_K": q4k_args, "Q5_K": q5k_args, "Q6_K": q6k_args, "Q4_0-like": f32_args(4), "Q5_0-like": f32_args(5)}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("isa", [isa_param("amx")])
def test_amx_gives_the_portable_bits_on_every_block_kind(isa, kind):
    x = torch.randn(100, K, generator=torch.Generator().manual_seed(15)).bfloat16()
    x[7] = 1
    x[7, ::2] = -1  # +-127 after quantization
    x[8, :32] = 0  # an all-zero group
    bias = torch.randn(N)
    for top in (False, True):
        gemm, args = KINDS[kind](top)
        for M in (32, 33, 47, 48, 100):  # AMX from 32 rows for groups of 16 and 32
            for out_fp32 in (True, False):
                xs = x[:M].contiguous()
                y = gemm(xs, *args, bias, out_fp32, INT4_ISAS[isa])
                ref = gemm(xs, *args, bias, out_fp32, INT4_ISAS["portable"])
                assert torch.equal(y, ref), (kind, top, M, out_fp32)
        alone = gemm(x[7:8].contiguous(), *args, bias, True, INT4_ISAS[isa])  # one row: the VNNI path
        assert torch.equal(alone[0], gemm(x[:40].contiguous(), *args, bias, True, INT4_ISAS[isa])[7])


def block_layer(kind: str):
    """A layer of random ``kind`` blocks, N x K, as a GGUF target's weights become."""
    from speculant.runtime.block_quant import BlockQuantLinear
    from speculant.runtime.kquant import KQuantLinear
    from test_gguf_legacy import random_legacy

    raw = {"Q4_K": lambda: random_q4k(N, K, seed=21), "Q5_K": lambda: random_q5k(N, K, seed=22),
           "Q6_K": lambda: random_q6k(N, K, seed=23)}.get(kind)
    if raw is not None:
        return KQuantLinear.from_blocks(raw(), kind=kind)
    return BlockQuantLinear.from_blocks(random_legacy(kind, N, K, seed=24), kind=kind)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q5_1", "Q8_0"])
def test_block_prefill_kernel_is_the_files_weights_in_bf16_and_rows_are_independent(kind):
    """int4_prefill_amx.cpp on a GGUF file's blocks: the file's own weights (exact in fp32) rounded
    once to bf16, times bf16 activations, summed in fp32 (a float64 reference up to fp32 summation);
    a row alone gives bit for bit what it gets inside a wider call; the bias added in fp32."""
    from speculant.kernels import cpu_kernels, kernels_name

    if kernels_name() != "amx":
        pytest.skip("the prefill kernels need AMX-BF16 (and the tile-data permission)")
    amx = cpu_kernels()
    layer = block_layer(kind)
    layer.bias32 = torch.randn(N)
    widened = layer.dequantize().bfloat16().double()
    x = torch.randn(150, K, generator=torch.Generator().manual_seed(25)).bfloat16()
    for M in (1, 17, 150):
        y = layer._run_prefill(amx, x[:M].contiguous()).double()
        ref = (x[:M].double() @ widened.T + layer.bias32.double()).bfloat16().double()
        torch.testing.assert_close(y, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
        for m in {0, M - 1}:
            assert torch.equal(layer._run_prefill(amx, x[m:m + 1].contiguous())[0], y[m].bfloat16()), (M, m)
    exact = x.double() @ layer.dequantize().double().T + layer.bias32.double()  # the unrounded weights
    rel = (y - exact).norm() / exact.norm()
    assert rel < 0.02


def test_forward_prefill_takes_the_prefill_kernel_only_on_amx():
    """A block layer's prompt rows go through the widened kernel where the int4 path is AMX, and
    through ``forward`` (the decoding kernels' bits) everywhere else."""
    from speculant.kernels import cpu_kernels, int4_isa, kernels_name

    layer = block_layer("Q4_K")
    x = torch.randn(100, K, generator=torch.Generator().manual_seed(26)).bfloat16()
    y = layer.forward_prefill(x)
    if int4_isa() == "amx" and kernels_name() == "amx":
        assert torch.equal(y, layer._run_prefill(cpu_kernels(), x))
        assert not torch.equal(y, layer(x))  # bf16 activations, not int8: other bits
    else:
        assert torch.equal(y, layer(x))
