"""Medusa heads (Cai et al. 2024), also the heads of blockwise parallel decoding (Stern et al. 2018):
K independent heads on the target's final hidden state, head k predicting token t + 2 + k.

Each head is ``num_layers`` :class:`~speculant.heads.layers.ResBlock` blocks, every block with its
own parameters, followed by a vocabulary projection: either a per-head ``Linear(H, V)`` (the
Medusa paper) or the target's frozen output layer (``shared_lm_head=True``; small to ship: the
output layer is passed in, used with detached weights, and never saved). Blocks start at zero, so
a fresh head is the identity followed by the projection.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..runtime.weights import weights_of
from .config import HeadsConfig
from .layers import ResBlock
from .projection import COARSE_EXTRA, check_lm_head, coarse_ranker, frozen_projection, layer_dtype, shortlist_topk

__all__ = ["MedusaHeads"]


class MedusaHeads(nn.Module):
    """K heads: ``forward(hidden (..., H)) -> logits (K, ..., V)``.

    ``lm_head``: the target's output layer ``(V, H)``. Required when ``config.shared_lm_head``
    (it is used, detached, as every head's projection and is not a parameter of this module);
    otherwise optional, and when given each head's projection starts as a copy of it.
    """


    def __init__(self, config: HeadsConfig, lm_head: nn.Module | None = None):
        super().__init__()
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        if lm_head is not None:
            check_lm_head(lm_head, config)
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
                        proj.weight.copy_(weights_of(lm_head).weight_matrix())
                layers.append(proj)
            heads.append(nn.Sequential(*layers))
        self.heads = nn.ModuleList(heads)
        # a tuple hides the target's layer from parameters(), state_dict() and .to()
        self._shared: tuple[nn.Module, ...] = (lm_head,) if config.shared_lm_head else ()
        # drafting through the shared layer shortlists candidates with a low-bit copy of it (int4
        # where an int4 path runs, see coarse_ranker); False: always the exact product
        self.coarse_ranking = True
        self._coarse: tuple | None = None  # (key, the layer's first `limit` rows, their int4 copy)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def output_layer(self) -> nn.Module | None:
        """The target's frozen output layer every head projects through (V, H), or None when each
        head has a projection of its own (``config.shared_lm_head`` False)."""
        return self._shared[0] if self._shared else None

    def _project(self, x: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        return frozen_projection(self._shared[0], x, vocab)

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
        return p.dtype if p is not None else layer_dtype(self._shared[0])

    @torch.no_grad()
    def draft_topk(self, hidden: torch.Tensor, k: int, depth: int | None = None,
                   limit: int | None = None, logprobs: bool = False):
        """hidden (H,) -> (depth, k) long: the k best tokens (< ``limit``) of the first ``depth``
        heads, as ``self(hidden)[:depth, :limit].topk(k)`` ranks them. Through a shared dense
        output layer, where a low-bit copy of it runs (``coarse_ranker``), the top k +
        COARSE_EXTRA of that copy are ranked exactly instead (reads ~1/4 of the bytes; differs only
        when the exact top k falls outside that shortlist). ``logprobs``: also return their
        log-probabilities (depth, k) float, normalised by the low-bit logits' log-sum-exp where
        the shortlist is used (dynamic trees score paths with them). hidden (B, H) (several
        sequences at once: one read of the output layer) -> (B, depth, k)."""
        depth = self.num_heads if depth is None else depth
        single = hidden.dim() == 1
        x = hidden.reshape(-1, hidden.shape[-1]).to(self.dtype)  # (B, H)
        B = x.shape[0]
        weights = weights_of(self.output_layer)
        weight = weights.dense_weight() if weights is not None else None
        idx = values = None
        if self.coarse_ranking and weight is not None and weights.bias is None:
            key = (weight.data_ptr(), weight.dtype, limit)
            if self._coarse is None or self._coarse[0] != key:
                rows = weight[:limit]
                self._coarse = (key, rows, coarse_ranker(rows))
            _, rows, coarse = self._coarse
            if coarse is not None and k + COARSE_EXTRA < rows.shape[0]:
                states = torch.stack([self.heads[j](x) for j in range(depth)], 1)  # (B, depth, H)
                idx, values, rough = shortlist_topk(coarse, rows, states.reshape(B * depth, -1), k)
                values = values - rough.logsumexp(-1, keepdim=True)
        if idx is None:
            logits = self(x)[:depth, :, :limit].float().transpose(0, 1)  # (B, depth, V')
            top = logits.topk(k, dim=-1, sorted=True)
            idx, values = top.indices, top.values - logits.logsumexp(-1, keepdim=True)
        idx, values = idx.reshape(B, depth, -1), values.reshape(B, depth, -1)
        if single:
            idx, values = idx[0], values[0]
        return (idx, values) if logprobs else idx

    def medusa_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under Medusa's names (contiguous copies, ready for safetensors)."""
        return {name: t.detach().contiguous().clone() for name, t in self.heads.state_dict().items()}

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights named as :meth:`medusa_state_dict` names them."""
        self.heads.load_state_dict(state)

