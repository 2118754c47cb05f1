"""speculant's kernels of the AMX / AVX-512 BF16 build (kernels.cpu_kernels): attention.cpp and the
bf16 matmul (bf16_amx.cpp / bf16_avx512.cpp) and the int4 prompt prefill on AMX
(int4_prefill_amx.cpp) against references, row independence (a row's output never depends on the
other rows), and the build's lock handling. The int4 kernel: test_kernels_x86.py."""

import pytest
import torch

from speculant.kernels import cpu_kernels, pack_bf16

kernel = cpu_kernels()
needs_kernel = pytest.mark.skipif(kernel is None, reason="needs AVX-512 BF16 and a C++ toolchain")


@needs_kernel
def test_attention_matches_reference_and_is_row_invariant():
    """kernels.attend over a tree-like mask equals float32 attention (bf16 rounding), and a row's
    output is bit-identical whether computed alone or with others (over the same visible keys)."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    n, H, grp, D, T = 6, 2, 3, 64, 90
    q = torch.randn(n, H, grp, D, generator=g).bfloat16()
    keys, values = (torch.randn(H, 128, D, generator=g).bfloat16() for _ in range(2))
    allowed = torch.ones(n, T, dtype=torch.bool).tril_(diagonal=T - n)
    allowed[3, T - n + 1:T - n + 3] = False  # a tree: node 3 does not see nodes 1, 2
    out = kernel.attend(q, keys, values, allowed)
    mask = torch.zeros(n, T).masked_fill_(~allowed, float("-inf"))
    ref = F.scaled_dot_product_attention(q.float().permute(1, 2, 0, 3), keys[:, None, :T].float(),
                                         values[:, None, :T].float(), attn_mask=mask).permute(2, 0, 1, 3)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    for i in range(n):
        assert torch.equal(kernel.attend(q[i:i + 1].contiguous(), keys, values, allowed[i:i + 1].contiguous())[0], out[i])
    # the same visible keys at other slots in the same order (a compacted path) give the same output
    seen = allowed[3].nonzero().flatten()
    k2, v2 = keys.clone(), values.clone()
    k2[:, :seen.numel()], v2[:, :seen.numel()] = keys[:, seen], values[:, seen]
    alone = kernel.attend(q[3:4].contiguous(), k2, v2, torch.ones(1, seen.numel(), dtype=torch.bool))
    assert torch.equal(alone[0], out[3])


@needs_kernel
@pytest.mark.parametrize("M", [1, 7, 16, 17, 32, 45, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_kernel_matches_fp32_matmul(M, bias):
    """bf16_amx.cpp / bf16_avx512.cpp: fp32 accumulation over all of K, so the result is the exact product rounded
    to bf16 (up to the order of the additions); every row count (one or two 16-row halves, slabs)."""
    g = torch.Generator().manual_seed(M)
    N, K = 96, 320
    w = (torch.randn(N, K, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(N, generator=g).to(torch.bfloat16) if bias else torch.empty(0, dtype=torch.bfloat16)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    ref = x.float() @ w.float().t() + (b.float() if bias else 0.0)
    y = kernel.bf16_mm(x, pack_bf16(w), b)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    torch.testing.assert_close(y.float(), ref.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    # every row is computed on its own: a one-row call gives it bit for bit (tree passes = path passes)
    for m in {0, M // 2, M - 1}:
        assert torch.equal(kernel.bf16_mm(x[m:m + 1].contiguous(), pack_bf16(w), b)[0], y[m])
    # the layout is a permutation: every weight lands in its tile slot
    wp = pack_bf16(w)
    assert wp.shape == (N // 16, K // 32, 16, 16, 2)
    assert torch.equal(wp[1, 2, 3, 4, 1], w[16 + 4, 64 + 2 * 3 + 1])


needs_prefill_kernel = pytest.mark.skipif(kernel is None or not hasattr(kernel, "int4_prefill_mm"),
                                          reason="the int4 prefill kernel needs AMX (Intel Sapphire Rapids or later)")


@needs_prefill_kernel
@pytest.mark.parametrize("N,K,gsize", [(48, 1024, 64), (96, 320, 32), (32, 64, 64)])  # 48: an odd last block
def test_int4_prefill_kernel_is_the_widened_product_and_rows_are_independent(N, K, gsize):
    """int4_prefill_amx.cpp: the weights widened to bf16 (fma(q, scale, offset), rounded once)
    times bf16 activations, summed in fp32: equal to that product computed in float64 up to fp32
    summation; a row alone gives bit for bit what it gets inside a wider call; bf16 output = the
    fp32 output rounded; the bias added in fp32."""
    from speculant.kernels import pack_int4_x86

    g = torch.Generator().manual_seed(N + K)
    q = torch.randint(0, 16, (N, K), generator=g)
    scale = torch.rand(N, K // gsize, generator=g) * 0.02 + 1e-3
    offset = -8 * scale + 0.002 * torch.randn(N, K // gsize, generator=g)
    qpack, sz = pack_int4_x86(q, scale, offset)
    s, o = sz.float().permute(2, 0, 3, 1).reshape(2, N, K // gsize).repeat_interleave(gsize, -1)  # (N, K) each
    widened = (q.double() * s.double() + o.double()).float().bfloat16()  # one rounding to fp32 (as an fma), then bf16
    bias = torch.randn(N, generator=g)
    x = torch.randn(150, K, generator=g).bfloat16()
    for M in (1, 15, 16, 17, 33, 150):
        y = kernel.int4_prefill_mm(x[:M].contiguous(), qpack, sz, bias, True)
        ref = x[:M].double() @ widened.double().T + bias.double()
        assert y.dtype == torch.float32 and y.shape == (M, N)
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        for m in {0, M // 2, M - 1}:
            assert torch.equal(kernel.int4_prefill_mm(x[m:m + 1].contiguous(), qpack, sz, bias, True)[0], y[m]), (M, m)
        assert torch.equal(kernel.int4_prefill_mm(x[:M].contiguous(), qpack, sz, bias, False), y.bfloat16())
    no_bias = kernel.int4_prefill_mm(x[:5].contiguous(), qpack, sz, torch.empty(0), True)
    assert torch.equal(no_bias + bias, kernel.int4_prefill_mm(x[:5].contiguous(), qpack, sz, bias, True))


@needs_prefill_kernel
def test_int4_prefill_kernel_bad_arguments_are_clear_errors():
    from speculant.kernels import pack_int4_x86

    qpack, sz = pack_int4_x86(torch.zeros(32, 128, dtype=torch.long), torch.ones(32, 2), torch.zeros(32, 2))
    with pytest.raises(RuntimeError, match="x has 64 columns, the weight 128"):
        kernel.int4_prefill_mm(torch.zeros(3, 64, dtype=torch.bfloat16), qpack, sz, torch.empty(0), True)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernel.int4_prefill_mm(torch.zeros(3, 128, dtype=torch.bfloat16), qpack, sz, torch.zeros(5), True)
    with pytest.raises(RuntimeError, match="x must be"):
        kernel.int4_prefill_mm(torch.zeros(3, 128), qpack, sz, torch.empty(0), True)


def test_pack_bf16_rejects_odd_shapes():
    with pytest.raises(ValueError, match="multiple|% 32"):
        pack_bf16(torch.zeros(48, 64, dtype=torch.bfloat16))


@needs_kernel
def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_load():
    """PyTorch's extension builder waits forever on a `lock` file a killed build left behind;
    speculant clears it under its own flock (which dies with its process) and loads."""
    import subprocess
    import sys

    from speculant import kernels
    build = kernels._build_directory(kernels._kernel_sources()[0])
    (build / "lock").touch()
    code = "from speculant.kernels import cpu_kernels; assert cpu_kernels() is not None"
    done = subprocess.run([sys.executable, "-c", code], timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (build / "lock").exists()


@needs_kernel
def test_the_module_matches_the_build_kernels_name_reports():
    """The AMX build (amx_module.cpp) has the AMX permission check; both builds have the bf16
    matmul and attention and no int4 matmul (int4 runs on the x86 module everywhere)."""
    from speculant.kernels import kernels_name

    assert kernels_name() in ("amx", "avx512")
    assert hasattr(kernel, "amx_available") == (kernels_name() == "amx")
    assert hasattr(kernel, "bf16_mm") and hasattr(kernel, "attend") and not hasattr(kernel, "int4_mm")
