"""A plain-PyTorch runtime for the decoder families of ``native_arch`` behind the Backend protocol.

Why: the transformers backend spends a good part of a decoding step in framework overhead (cache
objects, mask preparation, generic attention dispatch), and it cannot drop a layer's dense weight
once quantized. This one is the decoder written out as tensor ops over weights it does not own:

    x = embed[tokens]                                         # (n, H)
    for each layer:
        h = rmsnorm(x) ; q, k, v = h Wq + bq, h Wk + bk, h Wv + bv   (biases: Qwen2 only)
        q, k = rope(q, positions), rope(k, positions)        # rotate-half RoPE, theta from config
        cache[layer] <- k, v at length .. length+n-1
        x = x + attention(q, cached k, v; tree mask) Wo       # GQA: H_q / H_kv query heads per kv head
        h = rmsnorm(x) ; x = x + (silu(h Wg) * (h Wu)) Wd
    logits = rmsnorm(x)[rows] Wlm                             # float32, only the rows asked for

The families' variations (``native_arch.Arch``): Gemma's scaled embeddings, GELU-tanh, q/k norms
(Qwen3, Gemma 3), the outputs of attention and MLP normed too (Gemma), sliding-window layers, and
Gemma 2's soft-capped attention scores and logits (its attention on speculant's kernel in bf16, else
in PyTorch, ``capped_attention``; every other family's on SDPA or speculant's kernels).

Shapes: n new tokens, c cached entries inside the tree mask's window, T = cache length + n,
H hidden, D head dim, H_q / H_kv query / key-value heads, g = H_q / H_kv.

``native_model.NativeModel`` holds the weights. ``NativeBackend`` runs one sequence over a
``StaticKVCache`` with the same forward / rollback / compact semantics as ``HFBackend``;
``NativeBackend.forward_many`` runs several sequences (each its own backend and cache) in one pass:
their rows are concatenated through every linear layer (one pass over the weights for all of
them), and each sequence's rows take RoPE, the cache write and attention over its own cache under
its own mask. Every kernel here is row-invariant, so each sequence gets bit for bit what its own
pass gives it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..kernels import amx_kernels, cpu_kernels, x86_kernels
from ..runtime.block_linear import BlockLinear
from ..runtime.quant import Int4Linear
from .base import CacheBacked, ForwardOut, ForwardRequest, HiddenNeed, check_layers
from ..runtime.native_cache import StaticKVCache
from .native_model import SUPPORTED, NativeBlock, NativeModel, rms_norm, rotate_half  # noqa: F401 (re-exported)

INVARIANT_ROWS = 64  # passes of up to this many tokens are row-invariant (see _attention_plan)
# A prompt (ForwardRequest.prefill) of at least this many tokens takes the prefill kernels: int4
# weights and a GGUF file's blocks widened to bf16 on AMX (Int4Linear and BlockLinear.forward_prefill)
# and PyTorch's flash attention.
# Measured crossover: docs/design-notes.md#prompt-prefill-on-amx. SPECULANT_EXACT_PREFILL=1 keeps
# prompts on the decoding kernels (then the output is the same on every x86 CPU at any prompt length).
PREFILL_MIN_ROWS = 96
PREFILL_LAYERS = (Int4Linear, BlockLinear)  # the layers with a prefill kernel (forward_prefill)
Q_BLOCK, KV_BLOCK = 32, 512  # PyTorch's CPU flash attention blocks for short queries / long keys
CAPPED_ROWS = 64  # a long pass's soft-capped attention (capped_attention), this many queries at a time
_CAUSAL = torch.empty(0, dtype=torch.bool)  # kernels' attend: no mask = causal


class NativeBackend(CacheBacked):
    """A NativeModel and its static KV cache for one sequence (the Backend protocol)."""

    shares_passes = True  # every sequence's rows through each linear layer at once

    def __init__(self, model: NativeModel | nn.Module, name: str = "native", capacity: int = 1024):
        self.model = model if isinstance(model, NativeModel) else NativeModel.from_hf(model)
        self.name = name
        self.vocab_size = self.model.vocab_size
        self.dtype = self.model.dtype
        m = self.model
        self.cache = StaticKVCache(len(m.blocks), m.kv_heads, m.head_dim, m.dtype, capacity)

    def _mask(self, n: int, past: int, tree_mask: torch.Tensor | None, positions: torch.Tensor | None = None,
              window: int = 0) -> torch.Tensor:
        """(n, T) bool, True = may attend; columns before the tree window are committed context.
        ``window`` > 0: a sliding window too, key position > query position - window (the new
        tokens at ``positions`` (n,), the committed ones at 0 .. past-1)."""
        T = past + n
        if tree_mask is None:
            allowed = torch.ones(n, T, dtype=torch.bool).tril_(diagonal=past)
        else:
            allowed = torch.ones(n, T, dtype=torch.bool)
            allowed[:, T - tree_mask.shape[1]:] = tree_mask
        if window:
            pos = positions if positions is not None else torch.arange(past, T)
            keys = torch.cat([torch.arange(past), pos])
            allowed &= keys[None, :] > pos[:, None] - window
        return allowed

    def _attention_plan(self, n: int, past: int, tree_mask: torch.Tensor | None, g: int, prefill: bool = False,
                        positions: torch.Tensor | None = None, window: int = 0):
        """``attend(q (n, Hkv, g, D), layer) -> (n, Hkv, g, D)``: attention of the n new tokens
        over the cache (positions 0 .. past+n-1) under the causal or tree mask (and a sliding
        ``window`` over the new tokens' ``positions``, when > 0).

        ``prefill`` (a prompt of ``PREFILL_MIN_ROWS`` tokens or more on an empty cache): one call of
        PyTorch's causal flash attention (fastest for long inputs; not row-invariant, which a
        prompt need not be).

        Passes of up to ``INVARIANT_ROWS`` tokens (decoding, tree verification) are row-invariant:
        each token's output is bit-identical to what a one-token pass at its position computes,
        so verifying a tree reproduces plain decoding exactly (in bf16 too). In bf16, where
        speculant's kernels run, ``kernels.attend`` does this by construction (and fastest).
        Otherwise PyTorch's fused CPU attention gives it when every call has the same shape class: queries padded to one
        block of ``Q_BLOCK`` rows (g query heads x Q_BLOCK // g tokens), keys padded with masked
        entries to a multiple of ``KV_BLOCK``. Longer passes (prefill: the prompt, the same for
        every method) take one call; query row j*n + i is head j of token i."""
        m, cache = self.model, self.cache
        if not m.arch.plain_attention:  # soft-capped scores or a scale of its own (Gemma 2): in PyTorch
            return self._capped_plan(n, past, tree_mask, positions, window)
        Hkv, D, T = m.kv_heads, m.head_dim, past + n
        windowed = window and T > window  # a window that leaves keys out
        if prefill and past == 0 and tree_mask is None:
            mask = self._mask(n, past, None, positions, window)[None, None] if windowed else None

            def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
                keys, values = cache.kv[layer, 0, :, :n][None], cache.kv[layer, 1, :, :n][None]  # (1, Hkv, n, D)
                o = F.scaled_dot_product_attention(q.reshape(n, Hkv * g, D).transpose(0, 1)[None], keys, values,
                                                   attn_mask=mask, is_causal=mask is None,
                                                   enable_gqa=True)  # (1, Hq, n, D)
                return o[0].transpose(0, 1).reshape(n, Hkv, g, D)
            return attend
        x86 = x86_kernels() if m.dtype == torch.bfloat16 and m.kernel_shapes else None
        if x86 is not None:  # speculant's own: row-invariant by construction at any width, no padding
            allowed = self._mask(n, past, tree_mask, positions, window) if tree_mask is not None or windowed \
                else _CAUSAL

            def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
                return x86.attend(q.contiguous(), cache.kv[layer, 0], cache.kv[layer, 1], allowed, past, 0)
            return attend
        allowed = self._mask(n, past, tree_mask, positions, window if windowed else 0)  # (n, T)
        if n > INVARIANT_ROWS:
            mask = torch.zeros(n, T, dtype=m.dtype).masked_fill_(~allowed, float("-inf")).repeat(g, 1)[None, None]

            def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
                keys, values = cache.kv[layer, 0, :, :T], cache.kv[layer, 1, :, :T]
                q = q.permute(1, 2, 0, 3).reshape(1, Hkv, g * n, D)
                o = F.scaled_dot_product_attention(q, keys[None], values[None], attn_mask=mask)
                return o.view(Hkv, g, n, D).permute(2, 0, 1, 3)
            return attend
        kernels = cpu_kernels() if m.dtype == torch.bfloat16 and m.kernel_shapes else None
        if kernels is not None:  # speculant's AVX-512 kernel: row-invariant by construction, no padding

            def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
                return kernels.attend(q.contiguous(), cache.kv[layer, 0], cache.kv[layer, 1], allowed)
            return attend
        per = max(1, Q_BLOCK // g)  # tokens per call
        Tp = -(-T // KV_BLOCK) * KV_BLOCK
        cache.reserve(Tp)  # the padding keys are cache slots past the end: finite, and masked out
        masks = []
        for s in range(0, n, per):
            c = min(per, n - s)
            al = torch.zeros(per, Tp, dtype=torch.bool)
            al[:c, :T] = allowed[s:s + c]
            al[c:, 0] = True  # padding query rows attend to something (their output is dropped)
            masks.append((s, c, torch.zeros(g * per, Tp, dtype=m.dtype).masked_fill_(~al.repeat(g, 1),
                                                                                       float("-inf"))[None, None]))

        def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
            keys, values = cache.kv[layer, 0, :, :Tp][None], cache.kv[layer, 1, :, :Tp][None]
            out = torch.empty_like(q)
            for s, c, mask in masks:
                qp = q.new_zeros(1, Hkv, g, per, D)
                qp[0, :, :, :c] = q[s:s + c].permute(1, 2, 0, 3)
                o = F.scaled_dot_product_attention(qp.view(1, Hkv, g * per, D), keys, values, attn_mask=mask)
                out[s:s + c] = o.view(Hkv, g, per, D)[:, :, :c].permute(2, 0, 1, 3)
            return out
        return attend

    def _capped_plan(self, n: int, past: int, tree_mask: torch.Tensor | None, positions: torch.Tensor | None,
                     window: int):
        """``_attention_plan``'s ``attend`` for an attention SDPA and speculant's kernels do not
        compute: scores soft-capped before the mask and scaled by the model's own factor
        (``Arch.attn_softcap``, ``Arch.attn_scale``: Gemma 2), see :func:`capped_attention`.

        In bf16, where speculant's kernels run, ``attend_capped`` computes it (soft cap included),
        row-invariant at any width. Otherwise passes of up to ``INVARIANT_ROWS`` tokens take each
        token on its own over exactly the keys it may see, gathered in key order: the shapes and
        values of a one-token pass at its
        position, so the same bits (row invariance). Longer passes (prompts) take ``CAPPED_ROWS``
        tokens at a time over all keys, masked."""
        m, cache = self.model, self.cache
        scale = m.arch.attn_scale if m.arch.attn_scale is not None else m.head_dim ** -0.5
        cap, T = m.arch.attn_softcap, past + n
        allowed = self._mask(n, past, tree_mask, positions, window)  # (n, T)
        x86 = x86_kernels() if m.dtype == torch.bfloat16 and m.kernel_shapes else None
        if x86 is not None:  # speculant's kernel: the same scores and cap, row-invariant at any width

            def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
                return x86.attend_capped(q.contiguous(), cache.kv[layer, 0], cache.kv[layer, 1], allowed, 0, scale,
                                         cap or 0.0, 0)
            return attend
        if n > INVARIANT_ROWS:

            def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
                keys, values = cache.kv[layer, 0, :, :T], cache.kv[layer, 1, :, :T]
                return torch.cat([capped_attention(q[s:s + CAPPED_ROWS], keys, values, allowed[s:s + CAPPED_ROWS],
                                                   scale, cap) for s in range(0, n, CAPPED_ROWS)])
            return attend
        seen = [row.nonzero()[:, 0] for row in allowed]  # each token's keys, in order

        def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
            keys, values = cache.kv[layer, 0], cache.kv[layer, 1]
            return torch.cat([capped_attention(q[i:i + 1], keys.index_select(1, idx), values.index_select(1, idx),
                                               None, scale, cap) for i, idx in enumerate(seen)])
        return attend

    @property
    def widened_prefill(self) -> bool:
        """Whether this model's prefill kernels compute its weights otherwise than decoding does
        (AMX's widened bf16 tiles: ``PREFILL_LAYERS.forward_prefill``), so a prompt's rows differ
        from decoding's in any case, whatever its attention."""
        if amx_kernels() is None:
            return False
        return any(isinstance(m, PREFILL_LAYERS) and getattr(m, "_isa", None) == "amx" for m in self.model.modules())

    def sibling(self) -> "NativeBackend":
        """A backend for another sequence over the same weights (its own, empty KV cache)."""
        return NativeBackend(self.model, self.name, self.cache.capacity)

    @torch.no_grad()
    def forward(self, tokens, positions=None, tree_mask=None, rows=None,
                want_hidden: HiddenNeed = HiddenNeed.NONE, layers=()) -> ForwardOut:
        return NativeBackend.forward_many([self], [ForwardRequest(tokens, positions, tree_mask, rows, want_hidden,
                                                                  tuple(layers))])[0]

    @staticmethod
    @torch.no_grad()
    def forward_many(backends: list["NativeBackend"], requests: list[ForwardRequest]) -> list[ForwardOut]:
        """One pass for several sequences: ``requests[b]`` on ``backends[b]`` (one model, distinct
        caches). The rows of all sequences, (N, H) with N = Σ n_b, go through each linear layer at
        once; RoPE, the cache write and attention run per sequence on its slice of rows."""
        m = backends[0].model
        Hq, Hkv, D = m.heads, m.kv_heads, m.head_dim
        g = Hq // Hkv
        # per sequence: (backend, past, n, first row, {window: attend}, [RoPE angles (n, D/2) per rope])
        seqs = []
        first, fast = 0, []
        exact_prefill = bool(os.environ.get("SPECULANT_EXACT_PREFILL"))
        for b, r in zip(backends, requests):
            n, past = r.tokens.shape[0], b.cache.length
            positions = r.positions if r.positions is not None else torch.arange(past, past + n)
            b.cache.reserve(past + n)
            if m.max_context and n and int(positions.max()) >= m.max_context:
                raise ConfigError(f"position {int(positions.max())} is past the {m.max_context} tokens this model "
                                  "runs exactly on the native backend (its original RoPE context): shorten the "
                                  "prompt or max_new_tokens, or use backend='hf'")
            freqs = [positions.float()[:, None] * rope.inv_freq[None, :] for rope in m.ropes]  # (n, D/2) each
            fast.append(r.prefill and n >= PREFILL_MIN_ROWS and not exact_prefill)
            plans = {w: b._attention_plan(n, past, r.tree_mask, g, fast[-1], positions, w) for w in set(m.windows)}
            seqs.append((b, past, n, first, plans, freqs))
            first += n
        linear = _linear_plan([(r0, n, f) for (_, _, n, r0, *_), f in zip(seqs, fast)])
        tapped = {i for r in requests if r.want_hidden is not HiddenNeed.NONE
                  for i in check_layers(r.layers, len(m.blocks))}
        taps: dict[int, torch.Tensor] = {}  # layer -> the residual stream entering it (N, H)
        x = m.embed[torch.cat([r.tokens for r in requests])] if len(requests) > 1 else m.embed[requests[0].tokens]
        if m.arch.embed_scale != 1.0:  # Gemma: the embeddings scaled by sqrt(H), in the model's dtype
            x = x * torch.tensor(m.arch.embed_scale, dtype=x.dtype)
        fused = x86_kernels() if m.dtype == torch.bfloat16 and m.kernel_shapes else None
        gelu = m.arch.act == "gelu_tanh"
        if fused is not None:  # layer_x86.cpp: norms, RoPE + cache write, SiLU * up in one call each
            tables = [[((f.cos() * rope.scale).contiguous(), (f.sin() * rope.scale).contiguous()) if rope.scale != 1.0
                       else (f.cos().contiguous(), f.sin().contiguous()) for f, rope in zip(fs, m.ropes)]
                      for *_, fs in seqs]
            norm = lambda t, w: fused.rms_norm(t.contiguous(), w, m.eps, 0)  # noqa: E731 -- rebound below to a 1-argument norm
            for i, blk in enumerate(m.blocks):
                if i in tapped:
                    taps[i] = x
                h = norm(x, blk.in_norm)
                qkv = linear(blk.qkv, h) if blk.qkv is not None else torch.cat(blk.project_qkv(h), dim=-1)
                if blk.q_norm is not None:  # each head's query and key normed first (Qwen3, Gemma 3)
                    qkv = _qk_normed(qkv, blk, Hq, Hkv, D, norm)
                outs = []
                for (b, past, n, r0, plans, _), tab in zip(seqs, tables):
                    cos, sin = tab[m.layer_rope[i]]
                    part = qkv[r0:r0 + n].contiguous()
                    q = fused.rope_qkv(part, cos, sin, Hq, Hkv, b.cache.kv[i], past, 0)  # (n, Hq, D)
                    outs.append(plans[m.windows[i]](q.view(n, Hkv, g, D), i).reshape(n, Hq * D))
                o = linear(blk.o_proj, outs[0] if len(outs) == 1 else torch.cat(outs))
                x = x + (norm(o, blk.attn_out_norm) if blk.attn_out_norm is not None else o)
                h = norm(x, blk.post_norm)
                gu = (linear(blk.gate_up, h) if blk.gate_up is not None
                      else torch.cat([blk.gate_proj(h), blk.up_proj(h)], -1))
                if gelu:
                    gate, up = gu.chunk(2, dim=-1)
                    act = F.gelu(gate, approximate="tanh") * up
                else:
                    act = fused.silu_mul(gu.contiguous(), 0)
                f = linear(blk.down_proj, act)
                x = x + (norm(f, blk.ffn_out_norm) if blk.ffn_out_norm is not None else f)
        else:
            tables = []
            for *_, fs in seqs:
                tab = []
                for f, rope in zip(fs, m.ropes):
                    emb = torch.cat((f, f), dim=-1)[:, None, :]  # (n, 1, D)
                    tab.append(((emb.cos() * rope.scale).to(m.dtype), (emb.sin() * rope.scale).to(m.dtype)))
                tables.append(tab)
            for i, blk in enumerate(m.blocks):
                if i in tapped:
                    taps[i] = x
                h = rms_norm(x, blk.in_norm, m.eps)
                q_all, k_all, v_all = blk.project_qkv(h)
                if blk.q_norm is not None:  # each head's query and key normed first (Qwen3, Gemma 3)
                    q_all = rms_norm(q_all.reshape(-1, Hq, D), blk.q_norm, m.eps).reshape(q_all.shape)
                    k_all = rms_norm(k_all.reshape(-1, Hkv, D), blk.k_norm, m.eps).reshape(k_all.shape)
                outs = []
                for (b, past, n, r0, plans, _), tab in zip(seqs, tables):
                    cos, sin = tab[m.layer_rope[i]]
                    q = rotate_half(q_all[r0:r0 + n].reshape(n, Hq, D), cos, sin)
                    k = rotate_half(k_all[r0:r0 + n].reshape(n, Hkv, D), cos, sin)
                    v = v_all[r0:r0 + n].reshape(n, Hkv, D)
                    b.cache.write(i, k.transpose(0, 1), v.transpose(0, 1), past)
                    outs.append(plans[m.windows[i]](q.view(n, Hkv, g, D), i).reshape(n, Hq * D))
                o = blk.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))
                x = x + (rms_norm(o, blk.attn_out_norm, m.eps) if blk.attn_out_norm is not None else o)
                f = blk.mlp(rms_norm(x, blk.post_norm, m.eps), gelu)
                x = x + (rms_norm(f, blk.ffn_out_norm, m.eps) if blk.ffn_out_norm is not None else f)
        for b, _, n, *_ in seqs:
            b.cache.advance(n)
        norm = (lambda t: fused.rms_norm(t.contiguous(), m.norm, m.eps, 0)) if fused is not None else \
            (lambda t: rms_norm(t, m.norm, m.eps))
        picked, counts = [], []  # the rows that get logits, all sequences' at once through the output layer
        for (_, _, n, r0, *_), r in zip(seqs, requests):
            sel = torch.arange(r0, r0 + n) if r.rows is None else r.rows + r0
            picked.append(sel)
            counts.append(sel.shape[0])
        h = norm(x.index_select(0, torch.cat(picked)) if len(picked) > 1 or requests[0].rows is not None else x)
        head = m.lm_head
        exact = isinstance(head, (Int4Linear, BlockLinear))  # logits in float32, not rounded to bf16
        logits = head.forward_float(h) if exact else head(h).float()  # (Σ m_b, V)
        if m.arch.final_softcap:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / m.arch.final_softcap) * m.arch.final_softcap
        full = norm(x) if any(r.want_hidden is HiddenNeed.ALL for r in requests) else None  # (N, H)
        results, at = [], 0
        for (_, _, n, r0, *_), r, c, sel in zip(seqs, requests, counts, picked):
            hidden = None
            if r.want_hidden is HiddenNeed.ALL:
                hidden = full[r0:r0 + n]
                if r.layers:
                    hidden = torch.cat([hidden] + [taps[i][r0:r0 + n].to(hidden.dtype) for i in r.layers], -1)
            elif r.want_hidden is HiddenNeed.LAST:
                hidden = h[at:at + c]
                if r.layers:
                    hidden = torch.cat([hidden] + [taps[i].index_select(0, sel).to(hidden.dtype) for i in r.layers], -1)
            results.append(ForwardOut(logits[at:at + c], hidden))
            at += c
        return results

    def reset(self) -> None:
        self.cache.reset()


def capped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor | None,
                     scale: float, cap: float) -> torch.Tensor:
    """Attention with soft-capped scores, as transformers' eager Gemma 2 attention computes it (in
    float32 here): s = q k * scale, s = cap * tanh(s / cap) (``cap`` 0: not capped), masked,
    softmax, times v. q (n, Hkv, g, D); keys, values (Hkv, T, D); allowed (n, T) bool, or None
    for all keys -> (n, Hkv, g, D) in q's dtype."""
    n, Hkv, g, D = q.shape
    s = torch.matmul(q.permute(1, 0, 2, 3).reshape(Hkv, n * g, D).float(), keys.float().transpose(1, 2)) * scale
    if cap:
        s = torch.tanh(s / cap) * cap  # (Hkv, n g, T)
    if allowed is not None:
        s = s.masked_fill(~allowed.repeat_interleave(g, dim=0), float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1), values.float())  # (Hkv, n g, D)
    return o.view(Hkv, n, g, D).transpose(0, 1).to(q.dtype)


def _qk_normed(qkv: torch.Tensor, blk: NativeBlock, Hq: int, Hkv: int, D: int, norm) -> torch.Tensor:
    """``qkv`` (N, (Hq + 2 Hkv) D) with each head's query and key RMS-normed by ``norm(rows (M, D),
    weight (D,))``, the values as they are: every row on its own, so the bits do not depend on N."""
    N = qkv.shape[0]
    q, k, v = qkv.split((Hq * D, Hkv * D, Hkv * D), dim=-1)
    q = norm(q.reshape(N * Hq, D).contiguous(), blk.q_norm).reshape(N, Hq * D)
    k = norm(k.reshape(N * Hkv, D).contiguous(), blk.k_norm).reshape(N, Hkv * D)
    return torch.cat((q, k, v), dim=-1)


def _linear_plan(spans: list[tuple[int, int, bool]]):
    """``linear(layer, h (N, K)) -> (N, out)`` for a pass whose sequences have rows r0 .. r0+n-1
    (``spans``: (r0, n, prefill kernels)): the prefill kernel (``forward_prefill``, where the layer
    has one) for the rows flagged, the layer's own forward for the others. Each kernel computes
    every row on its own, so splitting the rows changes no bits."""
    if not any(f for *_, f in spans):
        return lambda layer, h: layer(h)
    if all(f for *_, f in spans):
        return lambda layer, h: (layer.forward_prefill if isinstance(layer, PREFILL_LAYERS) else layer)(h)
    fast = torch.cat([torch.arange(r0, r0 + n) for r0, n, f in spans if f])
    rest = torch.cat([torch.arange(r0, r0 + n) for r0, n, f in spans if not f])

    def linear(layer, h: torch.Tensor) -> torch.Tensor:
        if not isinstance(layer, PREFILL_LAYERS):
            return layer(h)
        prefill = layer.forward_prefill
        out = h.new_empty(h.shape[0], layer.out_features)
        out[rest] = layer(h[rest])
        out[fast] = prefill(h[fast])
        return out
    return linear
