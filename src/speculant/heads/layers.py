"""The trainable building blocks of heads: :class:`ResBlock` (Medusa's residual block) and the
prefix-attention :class:`ContextLayer` of sequential heads with its decoding cache
:class:`ContextCache`. H = hidden size."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attention_dtype, grouped_attention

__all__ = ["ContextCache", "ContextLayer", "ResBlock"]


class ResBlock(nn.Module):
    """``x + SiLU(Linear(x))``, (..., H) -> (..., H); zero-initialised (starts as the identity)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class ContextCache:
    """The keys and values a :class:`ContextLayer` has seen during decoding: (heads, L, head_dim)
    each (float32 for a bf16 layer: see :func:`~speculant.heads.attention.grouped_attention`), in a
    buffer that doubles when full; ``length`` = L, also the next position."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def _write(self, k: torch.Tensor, v: torch.Tensor, at: int) -> int:
        """Rows at .. at + n of the buffers become k, v (heads, n, head_dim), the rows before
        ``at`` kept (the buffers double when full). Returns at + n."""
        end = at + k.shape[1]
        if self.k is None or end > self.k.shape[1]:
            cap = max(64, 2 * end)
            grown = [t.new_empty(t.shape[0], cap, t.shape[2]) for t in (k, v)]
            if self.k is not None:
                grown[0][:, :at], grown[1][:, :at] = self.k[:, :at], self.v[:, :at]
            self.k, self.v = grown
        self.k[:, at:end], self.v[:, at:end] = k, v
        return end

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (heads, n, head_dim) -> every key and value so far (heads, L + n, head_dim), views."""
        self.length = self._write(k, v, self.length)
        return self.k[:, :self.length], self.v[:, :self.length]


class ContextLayer(nn.Module):
    """Prefix attention (after Hydra++, Ankner et al. 2024): one pre-norm transformer block over the
    target's final hidden states h_0 .. h_t (causal self-attention with rotary positions, then a
    SwiGLU MLP of width ``inter``). Its output at t replaces h_t as the first state of
    :class:`SequentialHeads`, so the heads read the context, not one position. The attention's and
    the MLP's output projections start at zero: a fresh layer is the identity.

    Training: ``forward(h (B, T, H)) -> (B, T, H)`` over whole sequences from position 0 (right
    padding is harmless under the causal mask). Decoding: ``extend(cache, h (n, H)) -> (n, H)`` for
    the n positions committed after ``cache.length``.
    Weights: ``norm1.weight``, ``qkv.weight`` (3H, H), ``qkv.bias``, ``o.weight`` (H, H),
    ``norm2.weight``, ``gate_up.weight`` (2·inter, H), ``down.weight`` (H, inter)."""

    HEAD_DIM = 128  # attention heads of 128 (one head of H when H is not a multiple of it)
    ROPE_THETA = 1e6

    def __init__(self, hidden_size: int, inter: int):
        super().__init__()
        H = hidden_size
        self.n_heads = H // self.HEAD_DIM if H % self.HEAD_DIM == 0 else 1
        self.head_dim = H // self.n_heads
        self.norm1 = nn.RMSNorm(H, eps=1e-6)
        self.qkv = nn.Linear(H, 3 * H)
        self.o = nn.Linear(H, H, bias=False)
        self.norm2 = nn.RMSNorm(H, eps=1e-6)
        self.gate_up = nn.Linear(H, 2 * inter, bias=False)
        self.down = nn.Linear(inter, H, bias=False)
        nn.init.zeros_(self.o.weight)
        nn.init.zeros_(self.down.weight)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x (..., T, D) rotated by positions pos (T,) (the rotate-half convention)."""
        D = x.shape[-1]
        inv = self.ROPE_THETA ** (-torch.arange(0, D, 2, dtype=torch.float32, device=x.device) / D)
        ang = pos.to(torch.float32)[:, None] * inv[None]  # (T, D/2)
        cos, sin = (torch.cat([f(ang)] * 2, -1).to(x.dtype) for f in (torch.cos, torch.sin))
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def _qkv(self, h: torch.Tensor, pos: torch.Tensor):
        """h (..., T, H) -> q, k, v (..., heads, T, D), q and k rotated."""
        qkv = self.qkv(self.norm1(h)).unflatten(-1, (3, self.n_heads, self.head_dim))
        q, k, v = qkv.movedim(-3, 0).transpose(-3, -2)
        return self._rope(q, pos), self._rope(k, pos), v

    def _rest(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """h (..., T, H), attn (..., heads, T, D) -> the block's output (..., T, H)."""
        x = h + self.o(attn.transpose(-3, -2).flatten(-2))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[-2], device=h.device)
        q, k, v = self._qkv(h, pos)
        return self._rest(h, F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def extend(self, cache: ContextCache, h: torch.Tensor) -> torch.Tensor:
        n = h.shape[0]
        q, k, v = self._qkv(h, torch.arange(cache.length, cache.length + n, device=h.device))
        kv = attention_dtype(q.dtype)
        keys, values = cache.append(k.to(kv), v.to(kv))
        mask = torch.ones(n, keys.shape[1], dtype=torch.bool, device=h.device).tril_(keys.shape[1] - n)
        return self._rest(h, grouped_attention(q, keys, values, mask))

