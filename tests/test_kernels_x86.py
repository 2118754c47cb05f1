"""speculant's kernels for every x86-64 CPU (kernels/int4_x86.cpp with its AMX path in
kernels/int4_amx_x86.cpp, kernels/attention_x86.cpp, kernels/layer_x86.cpp).

Every code path the CPU has (AMX, AVX-512 VNNI, AVX2 with or without AVX-VNNI, portable C++) is checked
against an exact reference, for bit identity with the others, and for row invariance (a row alone
gives bit for bit what it gets inside a 32-row call). Paths the CPU lacks are skipped with the
reason; the portable path runs everywhere."""

import pytest
import torch

from speculant.kernels import INT4_ISAS, dequantize_int4_x86, pack_int4_x86, unpack_int4_x86, x86_kernels

kernels = x86_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="needs an x86-64 CPU and a C++ toolchain")

ISAS = list(INT4_ISAS)


def isa_param(name):
    ok = kernels is not None and kernels.int4_isa_supported(INT4_ISAS[name])
    return pytest.param(name, marks=pytest.mark.skipif(not ok, reason=f"this CPU lacks the {name} instructions"))


def random_weight(N, K, gsize, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=g)
    scale = torch.rand(N, K // gsize, generator=g) * 0.02 + 1e-3
    offset = -8 * scale + 0.002 * torch.randn(N, K // gsize, generator=g)
    return q, scale, offset


def exact_reference(x, q, sz, gsize):
    """What the kernel computes, in float64: x quantized per row and group as the kernel does
    (absmax to int8, round to even), integer dot products, folded with the bf16 scales."""
    M, K = x.shape
    N = q.shape[0]
    G = K // gsize
    xg = x.float().view(M, G, gsize)
    mx = xg.abs().amax(-1, keepdim=True)
    # 127 / mx rounded once to float32, as the kernel divides (torch's `127 / mx` is 127 * (1 / mx))
    inv = torch.where(mx > 0, (127 / mx.double()).float(), torch.zeros_like(mx))
    xq = torch.round(xg * inv)  # float32 product, rounded half to even, as the kernel
    a = torch.where(mx > 0, (mx.double() / 127).float(), torch.ones_like(mx))[..., 0]  # (M, G)
    d = torch.einsum("mgk,ngk->mng", xq.double(), q.view(N, G, gsize).double())  # exact integers
    s, o = sz.double().permute(2, 0, 3, 1).reshape(2, N, G)
    return (a.double()[:, None] * (s[None] * d + o[None] * xq.sum(-1).double()[:, None])).sum(-1)


def test_pack_unpack_round_trip():
    q, scale, offset = random_weight(48, 256, 64)
    qpack, sz = pack_int4_x86(q, scale, offset)
    assert qpack.shape == (3, 32, 64) and sz.shape == (3, 4, 2, 16)
    assert torch.equal(unpack_int4_x86(qpack).long(), q)
    s, o = sz.float().permute(2, 0, 3, 1).reshape(2, 48, 4)
    expect = (q.view(48, 4, 64) * s[..., None] + o[..., None]).view(48, 256).bfloat16()
    assert torch.equal(dequantize_int4_x86(qpack, sz), expect)
    rows = torch.tensor([47, 0, 17, 17, 33])
    assert torch.equal(dequantize_int4_x86(qpack, sz, rows=rows), expect[rows])
    with pytest.raises(ValueError, match="N % 16 == 0"):
        pack_int4_x86(q[:40], scale[:40], offset[:40])


@pytest.mark.parametrize("isa", [isa_param(i) for i in ISAS])
@pytest.mark.parametrize("N,K,gsize", [(96, 256, 64), (48, 512, 32), (32, 1536, 64), (64, 384, 128)])
def test_int4_matches_exact_reference_on_every_width(isa, N, K, gsize):
    q, scale, offset = random_weight(N, K, gsize)
    qpack, sz = pack_int4_x86(q, scale, offset)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(1)).bfloat16()
    x[3, :gsize] = 0  # an all-zero group
    ref = exact_reference(x, q, sz, gsize)
    W = dequantize_int4_x86(qpack, sz).double()
    for M in list(range(1, 33)) + [40]:
        y = kernels.int4_gemm(x[:M].contiguous(), qpack, sz, torch.empty(0), True, INT4_ISAS[isa])
        assert y.shape == (M, N) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), ref[:M], rtol=1e-5, atol=1e-5)
    # and within int8 activation rounding of the unquantized product
    exact = x.double() @ W.T
    assert ((y.double() - exact).norm() / exact.norm()) < 0.015


@pytest.mark.parametrize("isa", [isa_param(i) for i in ISAS])
@pytest.mark.parametrize("gsize", [32, 64, 128])
def test_int4_extreme_codes_and_activations_stay_exact(isa, gsize):
    """The largest integer sums a group can reach (every code 15, every activation +-127) do not
    overflow the narrow accumulators of any path: 7 rows, so a full chunk and a ragged one run, and
    each row alone (one row takes a code path of its own on AVX2)."""
    N, K = 32, 4 * gsize
    q = torch.full((N, K), 15)
    q[N // 2:, ::3] = 0  # some channels not at the extreme either
    scale, offset = torch.full((N, K // gsize), 0.01), torch.full((N, K // gsize), -0.05)
    qpack, sz = pack_int4_x86(q, scale, offset)
    x = torch.ones(7, K, dtype=torch.bfloat16)
    x[1] = -1
    x[2, ::2] = -1
    ref = exact_reference(x, q, sz, gsize)
    y = kernels.int4_gemm(x, qpack, sz, torch.empty(0), True, INT4_ISAS[isa])
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(y, kernels.int4_gemm(x, qpack, sz, torch.empty(0), True, INT4_ISAS["portable"]))
    for m in range(3):
        assert torch.equal(kernels.int4_gemm(x[m:m + 1].contiguous(), qpack, sz, torch.empty(0), True,
                                             INT4_ISAS[isa])[0], y[m])


@pytest.mark.parametrize("isa", [isa_param(i) for i in ISAS])
def test_int4_rows_are_independent_bit_for_bit(isa):
    """Row i alone == row i inside a 32-row call, and == every other code path's, in fp32 and bf16."""
    q, scale, offset = random_weight(80, 512, 64, seed=2)
    qpack, sz = pack_int4_x86(q, scale, offset)
    bias = torch.randn(80)
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    i = INT4_ISAS[isa]
    full = kernels.int4_gemm(x, qpack, sz, bias, True, i)
    portable = kernels.int4_gemm(x, qpack, sz, bias, True, INT4_ISAS["portable"])
    assert torch.equal(full, portable)
    for m in range(32):
        assert torch.equal(kernels.int4_gemm(x[m:m + 1].contiguous(), qpack, sz, bias, True, i)[0], full[m])
    for lo, hi in [(5, 12), (9, 26), (0, 17)]:  # ragged chunks of rows
        assert torch.equal(kernels.int4_gemm(x[lo:hi].contiguous(), qpack, sz, bias, True, i), full[lo:hi])
    y16 = kernels.int4_gemm(x, qpack, sz, bias, False, i)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, full.bfloat16())


@pytest.mark.parametrize("isa", [isa_param("amx")])
def test_int4_amx_gives_the_vnni_bits_at_every_width_up_to_a_prefill(isa):
    """The AMX path (passes of 9 rows or more) against the portable path, bit for bit, at tile
    boundaries and a prompt's width: whole and ragged 16-row tiles, fp32 and bf16 with a bias, and
    the largest integer sums a group can reach."""
    q, scale, offset = random_weight(112, 1024, 64, seed=4)
    qpack, sz = pack_int4_x86(q, scale, offset)
    bias = torch.randn(112)
    x = torch.randn(150, 1024, generator=torch.Generator().manual_seed(5)).bfloat16()
    x[7] = 1
    x[7, ::2] = -1  # +-127 after quantization: extreme sums with code 15 below
    qpack15, sz15 = pack_int4_x86(torch.full((112, 1024), 15), scale, offset)
    for M in (9, 15, 16, 17, 32, 33, 64, 150):
        for out_fp32 in (True, False):
            for w, s in ((qpack, sz), (qpack15, sz15)):
                y = kernels.int4_gemm(x[:M].contiguous(), w, s, bias, out_fp32, INT4_ISAS[isa])
                ref = kernels.int4_gemm(x[:M].contiguous(), w, s, bias, out_fp32, INT4_ISAS["portable"])
                assert torch.equal(y, ref), (M, out_fp32)


def test_int4_bad_arguments_are_clear_errors():
    q, scale, offset = random_weight(32, 256, 64)
    qpack, sz = pack_int4_x86(q, scale, offset)
    with pytest.raises(RuntimeError, match="columns"):
        kernels.int4_gemm(torch.zeros(2, 128).bfloat16(), qpack, sz, torch.empty(0), False, 0)
    with pytest.raises(RuntimeError, match="bf16"):
        kernels.int4_gemm(torch.zeros(2, 256), qpack, sz, torch.empty(0), False, 0)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.int4_gemm(torch.zeros(2, 256).bfloat16(), qpack, sz, torch.zeros(31), False, 0)


ATT_ISAS = {"avx512": 1, "avx2": 3, "portable": 4}


def att_param(name):
    ok = kernels is not None and kernels.attend_isa_supported(ATT_ISAS[name])
    return pytest.param(name, marks=pytest.mark.skipif(not ok, reason=f"this CPU lacks the {name} instructions"))


def reference_attention(q, keys, values, allowed):
    n, H, g, D = q.shape
    out = torch.empty(n, H, g, D)
    for i in range(n):
        idx = allowed[i].nonzero()[:, 0]
        for h in range(H):
            scores = q[i, h].float() @ keys[h, idx].float().T / D ** 0.5
            out[i, h] = torch.softmax(scores, -1) @ values[h, idx].float()
    return out


@pytest.mark.parametrize("isa", [att_param(i) for i in ATT_ISAS])
@pytest.mark.parametrize("n,H,g,D,T", [(6, 2, 3, 64, 90), (1, 2, 6, 128, 700), (33, 2, 6, 128, 600)])
def test_attention_matches_reference_is_row_invariant_and_the_same_on_every_path(isa, n, H, g, D, T):
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(n, H, g, D, generator=gen).bfloat16()
    keys = torch.randn(H, T + 20, D, generator=gen).bfloat16()  # a slab longer than the context
    values = torch.randn(H, T + 20, D, generator=gen).bfloat16()
    allowed = torch.rand(n, T, generator=gen) < 0.7
    allowed[:, 0] = True
    i = ATT_ISAS[isa]
    out = kernels.attend(q, keys, values, allowed, 0, i)
    assert torch.equal(out, kernels.attend(q, keys, values, allowed, 0, ATT_ISAS["portable"]))
    torch.testing.assert_close(out.float(), reference_attention(q, keys, values, allowed), atol=4e-3, rtol=1e-2)
    for r in {0, n // 2, n - 1}:
        assert torch.equal(kernels.attend(q[r:r + 1].contiguous(), keys, values, allowed[r:r + 1].contiguous(), 0, i)[0],
                           out[r])
    past = T - n  # the causal mask without a mask tensor: token r sees keys 0 .. past + r
    causal = torch.ones(n, T, dtype=torch.bool).tril_(diagonal=past)
    assert torch.equal(kernels.attend(q, keys, values, torch.empty(0, dtype=torch.bool), past, i),
                       kernels.attend(q, keys, values, causal, 0, i))


def test_int4_linear_takes_the_x86_layout_and_its_rows_are_independent():
    """Int4Linear packs for int4_x86.cpp on every x86 CPU (AMX ones included) and runs the path
    int4_isa() names at every width: each of 12 rows (past the AMX path's 10) equals that row
    alone, bit for bit, and the output is the dequantized product up to int8 activation rounding."""
    from torch import nn

    from speculant.kernels import int4_isa
    from speculant.runtime.quant import Int4Linear

    torch.manual_seed(0)
    lin = nn.Linear(128, 48, bias=True).to(torch.bfloat16)
    q = Int4Linear(lin, keep_dense=False)
    assert q.kind == "x86" and q._isa == int4_isa() and q.qweight.shape == (3, 16, 64)
    x = torch.randn(12, 128).bfloat16()
    y = q(x)
    assert all(torch.equal(q(x[i:i + 1])[0], y[i]) for i in range(12))
    ref = x.float() @ q.dequantize().float().T + lin.bias.float()
    assert ((y.float() - ref).norm() / ref.norm()) < 0.015


def test_forced_isa_environment(monkeypatch):
    from speculant import kernels as k
    from speculant.errors import ConfigError

    monkeypatch.setenv("SPECULANT_INT4_ISA", "portable")
    assert k.int4_isa() == "portable"
    monkeypatch.setenv("SPECULANT_INT4_ISA", "sse9")
    with pytest.raises(ConfigError, match="choose one of"):
        k.int4_isa()


@pytest.mark.parametrize("isa", [att_param(i) for i in ATT_ISAS])
def test_layer_ops_match_torch_and_every_path(isa):
    """RMSNorm, silu(gate) * up and RoPE with the cache write: within bf16 rounding of PyTorch's
    float32 computation, row by row the same as alone, and the same bits on every code path."""
    import torch.nn.functional as F
    gen = torch.Generator().manual_seed(0)
    i, P = ATT_ISAS[isa], ATT_ISAS["portable"]
    x = (torch.randn(5, 96, generator=gen) * 3).bfloat16()
    w = torch.randn(96, generator=gen).bfloat16()
    y = kernels.rms_norm(x, w, 1e-6, i)
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    torch.testing.assert_close(y.float(), ref, atol=0.02, rtol=0.01)
    assert torch.equal(y, kernels.rms_norm(x, w, 1e-6, P))
    assert torch.equal(y[2], kernels.rms_norm(x[2:3].contiguous(), w, 1e-6, i)[0])

    gu = (torch.randn(4, 2 * 80, generator=gen) * 4).bfloat16()
    y = kernels.silu_mul(gu, i)
    ref = F.silu(gu[:, :80].float()) * gu[:, 80:].float()
    torch.testing.assert_close(y.float(), ref, atol=0.02, rtol=0.01)
    assert torch.equal(y, kernels.silu_mul(gu, P))

    n, Hq, Hkv, D, C, start = 3, 4, 2, 64, 10, 5
    qkv = torch.randn(n, (Hq + 2 * Hkv) * D, generator=gen).bfloat16()
    pos = torch.arange(start, start + n).float()
    freqs = pos[:, None] / 10000 ** (torch.arange(0, D, 2).float() / D)
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    slab = torch.zeros(2, Hkv, C, D).bfloat16()
    q = kernels.rope_qkv(qkv, cos, sin, Hq, Hkv, slab, start, i)

    def rope(t):  # (n, H, D) float
        half = D // 2
        c, s = cos[:, None], sin[:, None]
        return torch.cat([t[..., :half] * c - t[..., half:] * s, t[..., half:] * c + t[..., :half] * s], -1)

    heads = qkv.float().view(n, Hq + 2 * Hkv, D)
    torch.testing.assert_close(q.float(), rope(heads[:, :Hq]), atol=0.03, rtol=0.01)
    torch.testing.assert_close(slab[0, :, start:start + n].float(), rope(heads[:, Hq:Hq + Hkv]).transpose(0, 1),
                               atol=0.03, rtol=0.01)
    assert torch.equal(slab[1, :, start:start + n], qkv.view(n, Hq + 2 * Hkv, D)[:, Hq + Hkv:].transpose(0, 1))
    assert slab[:, :, :start].abs().sum() == 0 and slab[:, :, start + n:].abs().sum() == 0
    slab2 = torch.zeros_like(slab)
    assert torch.equal(q, kernels.rope_qkv(qkv, cos, sin, Hq, Hkv, slab2, start, P)) and torch.equal(slab, slab2)


def test_no_amx_environment_runs_as_without_amx(monkeypatch):
    """SPECULANT_NO_AMX: no AMX build and the int4 matmul's AVX-512 VNNI path, whatever the CPU."""
    from speculant import kernels as k

    monkeypatch.setenv("SPECULANT_NO_AMX", "1")
    assert not k.cpu_has_amx_int8()
    assert k.int4_isa() != "amx"
    if kernels.int4_isa_supported(INT4_ISAS["amx"]):
        assert k.int4_isa() == "avx512-vnni"
