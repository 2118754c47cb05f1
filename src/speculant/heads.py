"""Medusa / blockwise-parallel heads on the target's final (normed) hidden state.

Notation: H = hidden size, V = vocabulary size, K = number of heads. For the hidden state
``h_t`` of position t (the one whose output layer predicts token t+1), head k (0-based)
predicts token ``t + 2 + k``: head 0 guesses the token *after* the target's own next token.

Each head is ``num_layers`` residual blocks ``x + SiLU(W x + b)`` — every block with its own
parameters — followed by a vocabulary projection: either a per-head ``Linear(H, V)`` (the Medusa
paper) or the target's frozen output layer (``shared_lm_head=True``; small to ship: the output
layer is passed in, used with detached weights, and never saved). Blocks start at zero, so a
fresh head is the identity followed by the projection.

Checkpoint layout (the Medusa one, readable by engines that load Medusa heads): a directory with

    config.json          {"medusa_num_heads": K, "medusa_num_layers": n,
                          "base_model_name_or_path": ..., "hidden_size": H, "vocab_size": V,
                          "speculant_shared_lm_head": bool}
    model.safetensors    "{k}.{j}.linear.weight" (H, H), "{k}.{j}.linear.bias" (H,)  j < n
                         "{k}.{n}.weight" (V, H)   per-head projection (absent when shared)

``medusa_lm_head.safetensors`` (the name Medusa's own releases use) is read as well.

:class:`SequentialHeads` (``kind="sequential"``, method ``hydra``) are speculant's own heads that
also read the tokens of the path they extend; they are saved in the same directory layout with
``"speculant_head_kind": "sequential"`` (and ``"speculant_draft_vocab"``) in the config, which
engines that load Medusa heads do not understand. :func:`load_heads` reads both kinds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError, ModelLoadError

__all__ = ["HEAD_KINDS", "ContextCache", "ContextLayer", "HeadsConfig", "MedusaHeads", "ResBlock", "SequentialHeads",
           "load_heads", "make_heads", "save_heads"]

HEAD_KINDS = ("medusa", "sequential")

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ALT_WEIGHTS_NAMES = ("medusa_lm_head.safetensors",)


@dataclass(frozen=True)
class HeadsConfig:
    """Shape of a set of heads. ``base_model``: the target they were trained for (informative)."""

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    shared_lm_head: bool = True
    base_model: str = ""
    kind: str = "medusa"  # "medusa" (MedusaHeads) or "sequential" (SequentialHeads)
    draft_vocab: int = 0  # sequential: propose only these many tokens (a stored id list), 0 = all
    context_size: int = 0  # sequential: a prefix-attention layer with this MLP width (ContextLayer), 0 = none

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ConfigError(f"heads kind must be one of {', '.join(HEAD_KINDS)}, got {self.kind!r}")
        if self.kind == "sequential" and not self.shared_lm_head:
            raise ConfigError("sequential heads project through the target's output layer: use shared_lm_head=True")
        if not isinstance(self.draft_vocab, int) or not 0 <= self.draft_vocab <= self.vocab_size:
            raise ConfigError(f"draft_vocab must be an integer in [0, {self.vocab_size}], got {self.draft_vocab!r}")
        if self.draft_vocab and self.kind != "sequential":
            raise ConfigError("a draft vocabulary is an option of sequential heads")
        if not isinstance(self.context_size, int) or self.context_size < 0:
            raise ConfigError(f"context_size must be an integer >= 0, got {self.context_size!r}")
        if self.context_size and self.kind != "sequential":
            raise ConfigError("a context (prefix-attention) layer is an option of sequential heads")
        for name in ("num_heads", "hidden_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"heads {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.num_layers, int) or self.num_layers < 0:
            raise ConfigError(f"heads num_layers must be an integer >= 0, got {self.num_layers!r}")

    def to_json(self) -> dict:
        return {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
                "base_model_name_or_path": self.base_model, "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size, "speculant_shared_lm_head": self.shared_lm_head,
                "speculant_head_kind": self.kind, "speculant_draft_vocab": self.draft_vocab,
                "speculant_context_size": self.context_size}


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
    each, in a buffer that doubles when full; ``length`` = L, also the next position."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (heads, n, head_dim) -> every key and value so far (heads, L + n, head_dim), views."""
        n, end = k.shape[1], self.length + k.shape[1]
        if self.k is None or end > self.k.shape[1]:
            cap = max(64, 2 * end)
            grown = [t.new_empty(t.shape[0], cap, t.shape[2]) for t in (k, v)]
            if self.k is not None:
                grown[0][:, :self.length], grown[1][:, :self.length] = self.k[:, :self.length], self.v[:, :self.length]
            self.k, self.v = grown
        self.k[:, self.length:end], self.v[:, self.length:end] = k, v
        self.length = end
        return self.k[:, :end], self.v[:, :end]


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
        q, k, v = self.qkv(self.norm1(h)).unflatten(-1, (3, self.n_heads, self.head_dim)).movedim(-3, 0).transpose(-3, -2)
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
        keys, values = cache.append(k, v)
        mask = torch.ones(n, keys.shape[1], dtype=torch.bool, device=h.device).tril_(keys.shape[1] - n)
        return self._rest(h, F.scaled_dot_product_attention(q, keys, values, attn_mask=mask))


class MedusaHeads(nn.Module):
    """K heads: ``forward(hidden (..., H)) -> logits (K, ..., V)``.

    ``lm_head``: the target's output layer ``(V, H)``. Required when ``config.shared_lm_head``
    (it is used, detached, as every head's projection and is not a parameter of this module);
    otherwise optional, and when given each head's projection starts as a copy of it.
    """

    conditioned = False  # the heads read the hidden state only (not the tokens of the path they extend)

    def __init__(self, config: HeadsConfig, lm_head: nn.Module | None = None):
        super().__init__()
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        if lm_head is not None:
            _check_lm_head(lm_head, config)
        elif config.shared_lm_head:
            raise ConfigError("shared_lm_head=True needs the target's output layer: pass "
                              "lm_head=model.get_output_embeddings()")
        # ModuleList of Sequential so that state_dict() names are Medusa's: "{k}.{j}.linear.weight".
        heads = []
        for _ in range(config.num_heads):
            layers: list[nn.Module] = [ResBlock(H) for _ in range(config.num_layers)]
            if not config.shared_lm_head:
                proj = nn.Linear(H, V, bias=False)
                if lm_head is not None:
                    with torch.no_grad():
                        proj.weight.copy_(lm_head.weight)
                layers.append(proj)
            heads.append(nn.Sequential(*layers))
        self.heads = nn.ModuleList(heads)
        # a tuple hides the target's layer from parameters(), state_dict() and .to()
        self._shared: tuple[nn.Module, ...] = (lm_head,) if config.shared_lm_head else ()
        # drafting through the shared layer shortlists candidates with an int4 copy of it where
        # speculant's AMX kernel runs (see _coarse_ranker); False: always the exact product
        self.coarse_ranking = True
        self._coarse: tuple | None = None  # (key, the layer's first `limit` rows, their int4 copy)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def _project(self, x: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        return _frozen_projection(self._shared[0], x, vocab)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None,
                vocab: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (..., H) -> logits (K, ..., V) in the projection's dtype. ``tokens`` is ignored
        (the interface of :class:`SequentialHeads`). ``vocab`` (V',) long: only these tokens' logits
        (K, ..., V') — a training shortcut, shared projection only."""
        if vocab is not None and not self._shared:
            raise ValueError("vocab= needs heads that project through the shared output layer")
        if hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden must have shape (..., {self.config.hidden_size}), got {tuple(hidden.shape)}")
        x = hidden.to(self.dtype)
        outs = torch.stack([head(x) for head in self.heads])  # (K, ..., V), or (K, ..., H) when shared
        # shared: one projection of all K heads at once, so the (V, H) layer is read once, not K times
        return self._project(outs, vocab) if self._shared else outs

    @property
    def dtype(self) -> torch.dtype:
        p = next(self.parameters(), None)
        return p.dtype if p is not None else _layer_dtype(self._shared[0])

    @torch.no_grad()
    def draft_topk(self, hidden: torch.Tensor, k: int, depth: int | None = None,
                   limit: int | None = None, logprobs: bool = False):
        """hidden (H,) -> (depth, k) long: the k best tokens (< ``limit``) of the first ``depth``
        heads, as ``self(hidden)[:depth, :limit].topk(k)`` ranks them. Through a shared dense
        output layer, where a low-bit copy of it runs (``_coarse_ranker``), the top k +
        COARSE_EXTRA of that copy are ranked exactly instead (reads ~1/4 of the bytes; differs only
        when the exact top k falls outside that shortlist). ``logprobs``: also return their
        log-probabilities (depth, k) float, normalised by the low-bit logits' log-sum-exp where
        the shortlist is used (dynamic trees score paths with them)."""
        depth = self.num_heads if depth is None else depth
        layer = self._shared[0] if self._shared else None
        weight = getattr(layer, "weight", None)
        if self.coarse_ranking and weight is not None and getattr(layer, "bias", None) is None:
            key = (weight.data_ptr(), weight.dtype, limit)
            if self._coarse is None or self._coarse[0] != key:
                rows = weight.detach()[:limit]
                self._coarse = (key, rows, _coarse_ranker(rows))
            _, rows, coarse = self._coarse
            if coarse is not None and k + COARSE_EXTRA < rows.shape[0]:
                x = hidden.to(self.dtype)
                states = torch.stack([self.heads[j](x) for j in range(depth)])  # (depth, H)
                idx, values, rough = _shortlist_topk(coarse, rows, states, k)
                return (idx, values - rough.logsumexp(-1, keepdim=True)) if logprobs else idx
        logits = self(hidden)[:depth, :limit].float()
        top = logits.topk(k, dim=-1, sorted=True)
        return (top.indices, top.values - logits.logsumexp(-1, keepdim=True)) if logprobs else top.indices

    def medusa_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under Medusa's names (contiguous copies, ready for safetensors)."""
        return {name: t.detach().contiguous().clone() for name, t in self.heads.state_dict().items()}

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights named as :meth:`medusa_state_dict` names them."""
        self.heads.load_state_dict(state)


class SequentialHeads(nn.Module):
    """Sequentially dependent heads: each depth also reads the token it extends (after Hydra,
    Ankner et al. 2024; the recurrent state is EAGLE's feature extrapolation without its attention).

    One step function, shared by every depth, carries a state ``s`` (H,) down a path of tokens:

        s_0 = h_t (the target's final hidden state at t),   e(y) = α · E[y] / rms(E[y])
        s_d = blocks(W [s_{d-1}; e(y_d)] + b)                d = 1 .. K
        logits_d = lm_head(s_d)                              predicts y_{d+1}

    with y_1 = token t+1 (the target's own next token: the tree's root), y_d the path's tokens, E
    the target's frozen input embeddings, ``blocks`` ``num_layers`` :class:`ResBlock` blocks and
    ``lm_head`` the target's frozen output layer. So ``logits_1`` predicts token t+2, as Medusa head
    0 does, but knowing token t+1; and in a tree each node's children depend on the node's own
    path, not only on its depth. K = ``num_heads`` is the deepest draft. W starts as [I, 0] and the
    blocks at zero.

    Draft vocabulary (``config.draft_vocab`` = V' > 0): drafting (:meth:`draft_topk`) ranks only
    the V' token ids stored in ``draft_vocab``, so each depth reads V' rows of the output layer
    instead of V (FR-Spec's observation: a frequent-token subset keeps nearly every accepted token;
    the target still verifies every token, so this changes the speed only).

    Context layer (``config.context_size`` > 0): s_0 is not h_t but a :class:`ContextLayer`'s
    output at t over h_0 .. h_t (``self.context``; the decoder keeps its :class:`ContextCache`).

    Weights (safetensors): ``fc.weight`` (H, 2H), ``fc.bias`` (H,), ``embed_scale`` (),
    ``blocks.{j}.linear.weight`` / ``.bias``, ``draft_vocab`` (V',) int64 when V' > 0,
    ``context.*`` with a context layer. Not loadable by engines that read Medusa heads.
    """

    conditioned = True

    def __init__(self, config: HeadsConfig, lm_head: nn.Module, embed: nn.Module):
        super().__init__()
        if config.kind != "sequential":
            raise ConfigError(f"SequentialHeads needs a config of kind 'sequential', got {config.kind!r}")
        _check_lm_head(lm_head, config)
        H = config.hidden_size
        weight = getattr(embed, "weight", None)
        if weight is None or weight.dim() != 2 or weight.shape[1] != H:
            raise ModelLoadError(f"sequential heads need the target's input embeddings (V, {H}); got "
                                 f"{None if weight is None else tuple(weight.shape)}")
        self.config = config
        self.fc = nn.Linear(2 * H, H)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :H].copy_(torch.eye(H))
            self.fc.bias.zero_()
        self.blocks = nn.Sequential(*[ResBlock(H) for _ in range(config.num_layers)])
        self.embed_scale = nn.Parameter(torch.tensor(1.0))
        self.context = ContextLayer(H, config.context_size) if config.context_size else None
        if config.draft_vocab:
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab, dtype=torch.long))
        else:
            self.draft_vocab = None
        self._shared: tuple[nn.Module, ...] = (lm_head, embed)  # frozen, not parameters, never saved
        self._draft_rows: tuple | None = None  # (key, draft vocabulary < limit, its output-layer rows, int4 copy)
        # drafting shortlists candidates through an int4 copy of those rows where speculant's AMX
        # kernel runs (see _coarse_ranker); False: always the exact product
        self.coarse_ranking = True

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_scale.dtype  # (fc.weight is gone once the layers are packed: packing.py)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (...,) long -> e(y) (..., H) in the heads' dtype (RMS-normalised, times α)."""
        e = F.embedding(tokens, self._shared[1].weight.detach()).to(self.dtype)
        return e * torch.rsqrt(e.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(self.dtype) * self.embed_scale

    def step(self, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """state (..., H), tokens (...,) long -> next state (..., H)."""
        return self.blocks(self.fc(torch.cat([state.to(self.dtype), self.embed(tokens)], -1)))

    def project(self, state: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """state (..., H) -> logits (..., V) through the target's frozen output layer (only the
        columns ``vocab`` (V',), when given)."""
        return _frozen_projection(self._shared[0], state, vocab)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None,
                vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced unroll: hidden (..., H), tokens (..., K') long with ``tokens[..., d]`` =
        y_{d+1} (K' <= K; negative entries are padding, read as token 0) -> logits (K', ..., V),
        ``logits[d]`` predicting y_{d+2} (over ``vocab`` (V',) only, when given: a training shortcut)."""
        if hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden must have shape (..., {self.config.hidden_size}), got {tuple(hidden.shape)}")
        if tokens is None or tokens.shape[:-1] != hidden.shape[:-1] or not 1 <= tokens.shape[-1] <= self.num_heads:
            raise ValueError(f"sequential heads need tokens (..., K') with K' in 1..{self.num_heads} along hidden "
                             f"{tuple(hidden.shape)}: tokens[..., d] is the token at t+1+d")
        return self.project(self.unroll(hidden, tokens), vocab)

    def unroll(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The states of :meth:`forward`: hidden (..., H), tokens (..., K') -> s_1 .. s_K' (K', ..., H).
        Trained, ``s_d`` approximates the target's own hidden state at t+d (``TrainConfig.feature_weight``)."""
        s, states = hidden, []
        for d in range(tokens.shape[-1]):
            s = self.step(s, tokens[..., d].clamp(min=0))
            states.append(s)
        return torch.stack(states)

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Store the draft vocabulary: ``config.draft_vocab`` distinct token ids < V."""
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        V = self.config.vocab_size
        if self.draft_vocab is None or ids.numel() != self.draft_vocab.numel() or ids.unique().numel() != ids.numel() \
                or int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ConfigError(f"the draft vocabulary must be {self.config.draft_vocab} distinct token ids in [0, {V})")
        self.draft_vocab.copy_(ids.sort().values)
        self._draft_rows = None

    @torch.no_grad()
    def draft_topk(self, state: torch.Tensor, k: int, limit: int | None = None,
                   logprobs: bool = False):
        """state (n, H) -> (n, k) long: the k best-ranked tokens (< ``limit``) of each state's
        logits, over the draft vocabulary when there is one. Ties: ``topk`` order. ``logprobs``:
        also return their log-probabilities (n, k) under the softmax over those tokens."""
        layer = self._shared[0]
        if self.draft_vocab is None:
            logits = self.project(state)[..., :limit].float()
            top = logits.topk(k, dim=-1, sorted=True)
            if logprobs:
                return top.indices, top.values - logits.logsumexp(-1, keepdim=True)
            return top.indices
        weight = getattr(layer, "weight", None)
        # the draft vocabulary cut to `limit`, and (dense layer) its rows of the output layer: a cached
        # copy, since slicing V' rows per call would cost as much as the product itself
        key = (limit, self.draft_vocab.data_ptr(), id(layer) if weight is None else (weight.data_ptr(), weight.dtype),
               self.coarse_ranking)
        if self._draft_rows is None or self._draft_rows[0] != key:
            vocab = self.draft_vocab if limit is None else self.draft_vocab[self.draft_vocab < limit]
            if weight is not None:
                rows = weight.detach()[vocab].contiguous()
            elif hasattr(layer, "dequantize_rows"):  # a quantized output layer: its draft-vocabulary rows,
                rows = layer.dequantize_rows(vocab).contiguous()  # dequantized once (not all V per call)
            else:
                rows = None
            self._draft_rows = (key, vocab, rows, _coarse_ranker(rows) if self.coarse_ranking else None)
        _, vocab, rows, coarse = self._draft_rows
        if rows is None:  # a quantized output layer: project everything, then keep the draft vocabulary
            logits = self.project(state)[..., vocab].float()
        elif coarse is not None and k + COARSE_EXTRA < rows.shape[0]:
            idx, values, rough = _shortlist_topk(coarse, rows, state, k)
            if logprobs:  # normalised by the int4 logits' log-sum-exp
                return vocab[idx], values - rough.logsumexp(-1, keepdim=True)
            return vocab[idx]
        else:
            logits = F.linear(state.to(rows.dtype), rows).float()
        top = logits.topk(k, dim=-1, sorted=True)
        if logprobs:
            return vocab[top.indices], top.values - logits.logsumexp(-1, keepdim=True)
        return vocab[top.indices]

    def mask_to_draft_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (..., V) with every token outside the draft vocabulary at -inf (as drafting sees them)."""
        if self.draft_vocab is None:
            return logits
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[self.draft_vocab[self.draft_vocab < logits.shape[-1]]] = True
        return logits.masked_fill(~keep, float("-inf"))

    def medusa_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().contiguous().clone() for name, t in self.state_dict().items()}

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(state)


COARSE_EXTRA = 8  # shortlist k + this many tokens with the int4 copy, then rank them exactly


def _shortlist_topk(coarse: nn.Module, rows: torch.Tensor, states: torch.Tensor, k: int):
    """The top k of ``states @ rows.T`` through the int4 copy ``coarse`` of ``rows`` (V', H): its
    top k + COARSE_EXTRA, ranked with the exact rows. states (n, H) -> (indices into rows (n, k),
    their exact logits (n, k) float, the int4 logits (n, V') float)."""
    rough = coarse(states.to(torch.bfloat16)).float()
    short = rough.topk(k + COARSE_EXTRA, dim=-1).indices  # (n, k + COARSE_EXTRA)
    exact = torch.einsum("nh,nkh->nk", states.to(rows.dtype), rows[short]).float()
    top = exact.topk(k, dim=-1, sorted=True)
    return short.gather(-1, top.indices), top.values, rough


def _coarse_ranker(rows: torch.Tensor | None):
    """A low-bit copy of output-layer rows (V', H) (a draft vocabulary's, or a whole shared
    layer's for Medusa heads), or None for shapes it does not take. int4 in groups of 64 inputs:
    through speculant's AMX kernel where it runs (~1 ms against ~5 ms in bf16 for a 32k x 1536
    draft vocabulary), else PyTorch's own int4 matmul (on an AVX-512 CPU without AMX: 1.8 ms
    against 6.7 in bf16 and 4.0 in int8, for one state); int8 with one scale per row where int4
    does not apply. The shortlist it gives is re-ranked with the exact rows, so the proposals change
    only where the true top-k falls outside the low-bit top-(k + COARSE_EXTRA), and the target
    verifies every token anyway."""
    from .kernels import GROUP
    from .quant import Int4Linear, Int8Linear

    if rows is None or rows.shape[0] < 1024:
        return None
    layer = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(rows.to(torch.bfloat16), requires_grad=False)
    try:
        if rows.shape[1] % GROUP == 0 and rows.shape[0] % 16 == 0:
            return Int4Linear(layer, keep_dense=False)
    except Exception:  # neither int4 path runs here (no kernel, no PyTorch int4 op): try int8
        pass
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return None
    return Int8Linear(layer, keep_dense=False)


def make_heads(config: HeadsConfig, model: nn.Module) -> "MedusaHeads | SequentialHeads":
    """Fresh heads of ``config`` for ``model`` (a transformers causal LM or NativeModel)."""
    if config.kind == "sequential":
        return SequentialHeads(config, model.get_output_embeddings(), model.get_input_embeddings())
    return MedusaHeads(config, model.get_output_embeddings())


def _frozen_projection(layer: nn.Module, x: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """The target's output layer on x (..., H) -> (..., V), or (..., V') for the rows ``vocab``
    (V',); gradients reach x, never the layer. A quantized output layer (the native backend's
    ``--quant-head``) is called as it is (inference only)."""
    if getattr(layer, "weight", None) is None:
        if vocab is not None:
            raise ValueError("vocab= needs a dense output layer (training runs on the transformers model)")
        return layer(x.to(layer.dtype))
    weight = layer.weight.detach()
    bias = layer.bias.detach() if getattr(layer, "bias", None) is not None else None
    if vocab is not None:
        weight, bias = weight[vocab], (bias[vocab] if bias is not None else None)
    return F.linear(x.to(weight.dtype), weight, bias)


def _layer_shape(layer: nn.Module) -> tuple[int, int] | None:
    """(V, H) of an output layer: a Linear's weight, or a quantized layer's (out, in) features."""
    weight = getattr(layer, "weight", None)
    if weight is not None and weight.dim() == 2:
        return tuple(weight.shape)
    if isinstance(getattr(layer, "out_features", None), int) and isinstance(getattr(layer, "in_features", None), int):
        return layer.out_features, layer.in_features
    return None


def _layer_dtype(layer: nn.Module) -> torch.dtype:
    weight = getattr(layer, "weight", None)
    return weight.dtype if weight is not None else layer.dtype  # quantized layers: their activation dtype


def _check_lm_head(lm_head: nn.Module, config: HeadsConfig) -> None:
    shape = _layer_shape(lm_head)
    if shape is None:
        raise ConfigError("lm_head must be the target's output layer (a module with a (V, H) weight)")
    V, H = shape
    if H != config.hidden_size:
        raise ModelLoadError(
            f"the heads read hidden states of size {config.hidden_size} but the target's hidden size is {H}: "
            f"these heads were trained for another model ({config.base_model or 'unknown base model'}); "
            "use heads trained for this target (speculant train-heads --target ...)")
    if V != config.vocab_size:
        raise ModelLoadError(
            f"the heads predict a vocabulary of {config.vocab_size} tokens but the target's output layer has {V}: "
            f"these heads were trained for another model ({config.base_model or 'unknown base model'}); "
            "use heads trained for this target (speculant train-heads --target ...)")


def save_heads(heads: "MedusaHeads | SequentialHeads", path: str | Path) -> Path:
    """Write ``heads`` to the directory ``path`` (created) in the Medusa layout; returns it."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_NAME).write_text(json.dumps(heads.config.to_json(), indent=2) + "\n")
    save_file(heads.medusa_state_dict(), str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    return out


def _read_config(directory: Path) -> dict:
    cfg_file = directory / CONFIG_NAME
    if not cfg_file.is_file():
        raise ModelLoadError(f"{directory} has no {CONFIG_NAME}: a heads checkpoint is a directory with "
                             f"{CONFIG_NAME} and {WEIGHTS_NAME} (written by save_heads / speculant train-heads)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_file} is corrupt (not valid JSON: {e}); re-save or re-download the heads") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_file} must hold a JSON object with medusa_num_heads, medusa_num_layers, ...")
    missing = [k for k in ("medusa_num_heads", "medusa_num_layers") if k not in cfg]
    if missing:
        raise ModelLoadError(f"{cfg_file} lacks {', '.join(missing)}: it is not a Medusa heads config")
    return cfg


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    for name in (WEIGHTS_NAME, *ALT_WEIGHTS_NAMES):
        if (directory / name).is_file():
            try:
                return load_file(str(directory / name))
            except Exception as e:  # safetensors raises its own error types for truncated / bad headers
                raise ModelLoadError(f"{directory / name} is corrupt ({e}); re-save or re-download the heads") from None
    hint = " (a .pt checkpoint: convert it to safetensors first)" if any(directory.glob("*.pt")) else ""
    raise ModelLoadError(f"{directory} has no {WEIGHTS_NAME}{hint}: a heads checkpoint needs its weights "
                         "in safetensors format")


def load_heads(path: str | Path, target_model: nn.Module,
               dtype: torch.dtype | None = None) -> "MedusaHeads | SequentialHeads":
    """Load heads saved by :func:`save_heads` (or Medusa's own layout) for ``target_model`` (a
    transformers causal LM or NativeModel).

    Checks them against the target's output layer (hidden and vocabulary sizes). A checkpoint
    without ``speculant_shared_lm_head`` (e.g. from Medusa) is shared iff it has no projection
    weights; one without ``speculant_head_kind`` holds Medusa heads. ``dtype``: default the target
    output layer's dtype.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"no heads checkpoint at {path}: expected a directory with {CONFIG_NAME} and "
                             f"{WEIGHTS_NAME} (train some with speculant train-heads)")
    raw = _read_config(directory)
    state = _read_weights(directory)
    lm_head = target_model.get_output_embeddings()
    shape = _layer_shape(lm_head)
    if shape is None:
        raise ModelLoadError("the target has no output layer with a (V, H) weight to check the heads against")
    V_t, H_t = shape
    K, n = raw["medusa_num_heads"], raw["medusa_num_layers"]
    kind = raw.get("speculant_head_kind", "medusa")
    has_proj = f"0.{n}.weight" in state
    shared = raw.get("speculant_shared_lm_head", not has_proj)
    # sizes the config does not state are read off the tensors (Medusa's own configs omit them)
    block, proj = state.get("0.0.linear.weight"), state.get(f"0.{n}.weight")
    hidden = raw.get("hidden_size") or (block.shape[1] if block is not None and block.dim() == 2 else
                                         proj.shape[1] if proj is not None and proj.dim() == 2 else H_t)
    vocab = raw.get("vocab_size") or (proj.shape[0] if proj is not None and proj.dim() == 2 else V_t)
    try:
        config = HeadsConfig(K, n, hidden, vocab, bool(shared), str(raw.get("base_model_name_or_path") or ""), kind,
                             int(raw.get("speculant_draft_vocab", 0) or 0),
                             int(raw.get("speculant_context_size", 0) or 0))
    except ConfigError as e:
        raise ModelLoadError(f"{directory / CONFIG_NAME} is invalid: {e}") from None
    _check_lm_head(lm_head, config)  # hidden / vocabulary mismatch with the target
    with torch.device("meta"):  # no time spent initialising (V, H) projections about to be replaced
        if kind == "sequential":
            heads = SequentialHeads(config, lm_head, target_model.get_input_embeddings())
            module = heads
        else:
            heads = MedusaHeads(config, lm_head if shared else None)
            module = heads.heads
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        what = (f"{K} heads x {n} blocks, {'shared' if shared else 'per-head'} projection" if kind == "medusa"
                else f"sequential heads of depth {K}, {n} blocks")
        raise ModelLoadError(
            f"{directory} does not match its config ({what}): "
            + (f"missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected tensors {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}" if unexpected else ""))
    for name, t in expected.items():
        if state[name].shape != t.shape:
            raise ModelLoadError(f"tensor {name} in {directory} has shape {tuple(state[name].shape)}, "
                                 f"expected {tuple(t.shape)} from its config: the checkpoint is corrupt")
    module.load_state_dict(state, assign=True)
    if kind == "sequential" and config.draft_vocab:
        try:
            heads.set_draft_vocab(heads.draft_vocab.clone())
        except ConfigError as e:
            raise ModelLoadError(f"{directory}: {e}: the checkpoint is corrupt") from None
    return heads.to(dtype or _layer_dtype(lm_head)).eval()


SHIPPED_TREE_NAME = "tree.json"  # the default sparse tree shipped next to a heads checkpoint


def shipped_heads(target_name: str, kind: str = "medusa") -> Path | None:
    """The heads directory shipped in the package for a preset target, or None: ``data/heads/<preset>``
    (Medusa heads) or ``data/heads/<preset>/sequential`` (``kind="sequential"``)."""
    from importlib import resources

    d = Path(str(resources.files("speculant").joinpath("data", "heads", target_name)))
    d = d / "sequential" if kind == "sequential" else d
    return d if (d / CONFIG_NAME).is_file() else None


def heads_tree(path: str | Path | None) -> str | None:
    """The JSON list of paths stored as ``tree.json`` next to a heads checkpoint (by ``build-tree``), or None."""
    if path is None:
        return None
    f = Path(path) / SHIPPED_TREE_NAME
    return f.read_text() if f.is_file() else None
