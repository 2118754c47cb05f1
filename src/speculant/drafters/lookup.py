"""Prompt lookup (model-free n-gram drafting): if the last n tokens occurred earlier in the
context, propose the γ tokens that followed their most recent earlier occurrence."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..tree import chain
from .base import Draft


class LookupDrafter:
    def __init__(self, gamma: int = 8, max_ngram: int = 3, min_ngram: int = 1):
        if gamma < 1:
            raise ConfigError(f"lookup draft length gamma must be >= 1, got {gamma}")
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.gamma, self.max_ngram, self.min_ngram = gamma, max_ngram, min_ngram

    def begin(self, prompt: torch.Tensor) -> None:
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
        return Draft(chain(cont.shape[0]), torch.cat([context[-1:], cont]))

    def observe(self, path: list[int], next_token: int) -> None:
        pass
