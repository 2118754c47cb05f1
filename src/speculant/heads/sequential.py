"""Sequential heads (method ``hydra``): one step function carried down a path of tokens, so each
depth's proposals depend on the path drafted so far (after Hydra, Ankner et al. 2024).
H = hidden size, V = vocabulary size, K = deepest draft."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, ModelLoadError
from .config import HeadsConfig
from .layers import ContextLayer, ResBlock
from .projection import DraftVocabulary, check_lm_head, layer_shape

__all__ = ["SequentialHeads"]


class SequentialHeads(DraftVocabulary, nn.Module):
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

    def __init__(self, config: HeadsConfig, lm_head: nn.Module, embed: nn.Module):
        super().__init__()
        if config.kind != "sequential":
            raise ConfigError(f"SequentialHeads needs a config of kind 'sequential', got {config.kind!r}")
        check_lm_head(lm_head, config)
        H = config.hidden_size
        shape = layer_shape(embed)
        if shape is None or shape[1] != H:
            raise ModelLoadError(f"sequential heads need the target's input embeddings (V, {H}); got {shape}")
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
        self._share_target(lm_head, embed)  # frozen, not parameters, never saved
        # drafting shortlists candidates through a low-bit copy of those rows (int4 where an int4
        # path runs, see coarse_ranker); False: always the exact product
        self.coarse_ranking = True

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_scale.dtype  # (fc.weight is gone once the layers are packed: packing.py)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (...,) long -> e(y) (..., H) in the heads' dtype (RMS-normalised, times α)."""
        e = F.embedding(tokens, self.input_embeddings.weight.detach()).to(self.dtype)
        return e * torch.rsqrt(e.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(self.dtype) * self.embed_scale

    def step(self, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """state (..., H), tokens (...,) long -> next state (..., H)."""
        return self.blocks(self.fc(torch.cat([state.to(self.dtype), self.embed(tokens)], -1)))

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

    def medusa_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().contiguous().clone() for name, t in self.state_dict().items()}

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(state)

