"""Prompt lookup (model-free n-gram drafting): if the last n tokens occurred earlier in the
context, propose the γ tokens that followed their most recent earlier occurrence.

With a ``sizer`` (``tuning.sizing.TreeSizer``, the machine's measured pass cost) a step verifies
only as many of the γ tokens as pay: the first c, for the most expected tokens per millisecond,
from the observed rate at which the chain's first j tokens are accepted. Where a verified row
costs little (AMX) that is the whole chain; where rows are dear (AVX-512 without AMX) it is
shorter, and longer while the text copies its context."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..trees.buffers import chain
from ..trees.draft import Draft
from .base import HiddenNeed, ProposesAlone


class LookupDrafter(ProposesAlone):
    hidden_need = HiddenNeed.NONE  # reads the context only
    hidden_layers = ()

    def __init__(self, gamma: int = 8, max_ngram: int = 3, min_ngram: int = 1, sizer=None):
        if gamma < 1:
            raise ConfigError(f"lookup draft length gamma must be >= 1, got {gamma}")
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.gamma, self.max_ngram, self.min_ngram = gamma, max_ngram, min_ngram
        self.sizer = sizer

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        pass

    def find(self, context: torch.Tensor) -> torch.Tensor:
        """The continuation (≤ γ tokens) of the longest, most recent n-gram match; maybe empty."""
        L = context.shape[0]
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            windows = context.unfold(0, n, 1)[: L - n]  # (L-n, n): every n-gram that has a successor
            hits = torch.nonzero((windows == context[L - n:]).all(-1)).flatten()
            if hits.numel():
                start = int(hits[-1]) + n
                return context[start:start + self.gamma]
        return context[:0]

    def propose(self, context: torch.Tensor) -> Draft:
        cont = self.find(context)
        if self.sizer is not None and cont.numel():
            _, c = self.sizer.choose([], [], cont.shape[0], context=int(context.shape[0]))
            cont = cont[:c]
            tokens = torch.cat([context[-1:], cont])
            self.sizer.drafted(tokens, cont.tolist(), [])
            return Draft(chain(cont.shape[0]), tokens)
        return Draft(chain(cont.shape[0]), torch.cat([context[-1:], cont]))

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None = None) -> None:
        if self.sizer is not None:
            self.sizer.observe(path)
