"""speculant's attention kernel with a scale of its own and soft-capped scores (Gemma 2's
attention: s = cap * tanh(q k * scale / cap), then the softmax): on every code path the CPU has,
close to PyTorch's ``capped_attention`` (float32), the same bits as the portable path, and
row-invariant (a row alone gets bit for bit its row of the whole pass); cap 0 is the plain kernel."""

from __future__ import annotations

import pytest
import torch

from speculant.backends.native import capped_attention
from speculant.kernels import x86_kernels

from test_kernels_x86 import ATT_ISAS, att_param

kernels = x86_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="needs an x86-64 CPU and a C++ toolchain")


@pytest.mark.parametrize("isa", [att_param(i) for i in ATT_ISAS])
@pytest.mark.parametrize("n,H,g,D,T", [(5, 2, 2, 64, 80), (1, 1, 8, 256, 300)])
def test_capped_attention_matches_pytorch_is_row_invariant_and_the_same_on_every_path(isa, n, H, g, D, T):
    gen = torch.Generator().manual_seed(T)
    q = (3 * torch.randn(n, H, g, D, generator=gen)).bfloat16()  # large scores: the cap bites
    keys = (3 * torch.randn(H, T + 8, D, generator=gen)).bfloat16()
    values = torch.randn(H, T + 8, D, generator=gen).bfloat16()
    allowed = torch.rand(n, T, generator=gen) < 0.8
    allowed[:, 0] = True
    scale, cap, i = 1 / 224 ** 0.5, 50.0, ATT_ISAS[isa]
    out = kernels.attend_capped(q, keys, values, allowed, 0, scale, cap, i)
    assert torch.equal(out, kernels.attend_capped(q, keys, values, allowed, 0, scale, cap, ATT_ISAS["portable"]))
    ref = capped_attention(q.float(), keys[:, :T].float(), values[:, :T].float(), allowed, scale, cap)
    torch.testing.assert_close(out.float(), ref, atol=4e-3, rtol=1e-2)
    uncapped = capped_attention(q.float(), keys[:, :T].float(), values[:, :T].float(), allowed, scale, 0.0)
    assert (out.float() - uncapped).abs().max() > 0.05  # the cap changes the result here
    for r in {0, n - 1}:
        alone = kernels.attend_capped(q[r:r + 1].contiguous(), keys, values, allowed[r:r + 1].contiguous(), 0, scale,
                                      cap, i)
        assert torch.equal(alone[0], out[r])
    plain = kernels.attend(q, keys, values, allowed, 0, i)
    assert torch.equal(kernels.attend_capped(q, keys, values, allowed, 0, 0.0, 0.0, i), plain)
