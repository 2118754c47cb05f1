"""Prompt lookup (model-free n-gram drafting): if the last n tokens occurred earlier in the
context, propose the γ tokens that followed their most recent earlier occurrence.

With a ``sizer`` (``tuning.sizing.TreeSizer``, the machine's measured pass cost) a step verifies
only as many of the γ tokens as pay: the first c, for the most expected tokens per millisecond,
from the observed rate at which the chain's first j tokens are accepted. Where a verified row
costs little (AMX) that is the whole chain; where rows are dear (AVX-512 without AMX) it is
shorter, and longer while the text copies its context.

A ``prediction`` (token ids of the text the output is expected to be, OpenAI's Predicted Outputs)
is one more source: while the output so far is the prediction's beginning, the chain is the
prediction's next γ tokens; otherwise the context's last n tokens are looked up in the prediction
too (at equal n before the context; among several matches, the first at or after where the last
chain from it began, since the output reads the prediction forward). A draft from the prediction
marks its nodes (``Draft.predicted``), so the loop can count how many of them the target accepted.
The target verifies every token either way: the output is unchanged."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..trees.buffers import chain
from ..trees.draft import Draft
from .base import HiddenNeed, ProposesAlone


class LookupDrafter(ProposesAlone):
    hidden_need = HiddenNeed.NONE  # reads the context only
    hidden_layers = ()

    def __init__(self, gamma: int = 8, max_ngram: int = 3, min_ngram: int = 1, sizer=None,
                 prediction: torch.Tensor | None = None):
        if gamma < 1:
            raise ConfigError(f"lookup draft length gamma must be >= 1, got {gamma}")
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.gamma, self.max_ngram, self.min_ngram = gamma, max_ngram, min_ngram
        self.sizer = sizer
        self.prediction = None if prediction is None or not len(prediction) else \
            torch.as_tensor(prediction, dtype=torch.long).flatten()
        self._prompt_len: int | None = None  # set by begin: where the output starts in the context
        self._cursor = 0  # where in the prediction the last chain taken from it began

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        self._prompt_len, self._cursor = int(prompt.shape[0]), 0

    def find(self, context: torch.Tensor) -> torch.Tensor:
        """The continuation (≤ γ tokens) of the longest, most recent n-gram match; maybe empty."""
        return self.match(context)[0]

    def match(self, context: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """:meth:`find`'s continuation, and whether it came from the prediction (module doc)."""
        L, pred = context.shape[0], self.prediction
        if pred is not None and self._prompt_len is not None:
            done = L - self._prompt_len  # tokens generated so far
            if 0 <= done < pred.shape[0] and torch.equal(context[self._prompt_len:], pred[:done]):
                self._cursor = done
                return pred[done:done + self.gamma], True
        for n in range(min(self.max_ngram, L), self.min_ngram - 1, -1):
            key = context[L - n:]
            if pred is not None and n < pred.shape[0]:
                hits = _hits(pred, key)
                if hits.numel():
                    ahead = hits[hits + n >= self._cursor]
                    start = int(ahead[0] if ahead.numel() else hits[-1]) + n
                    self._cursor = start
                    return pred[start:start + self.gamma], True
            if n < L:
                hits = _hits(context, key)
                if hits.numel():
                    start = int(hits[-1]) + n
                    return context[start:start + self.gamma], False
        return context[:0], False

    def propose(self, context: torch.Tensor) -> Draft:
        cont, predicted = self.match(context)
        if self.sizer is not None and cont.numel():
            _, c = self.sizer.choose([], [], cont.shape[0], context=int(context.shape[0]))
            cont = cont[:c]
            tokens = torch.cat([context[-1:], cont])
            self.sizer.drafted(tokens, cont.tolist(), [])
        else:
            tokens = torch.cat([context[-1:], cont])
        marks = chain_marks(cont.shape[0]) if predicted else None
        return Draft(chain(cont.shape[0]), tokens, predicted=marks)

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None = None) -> None:
        if self.sizer is not None:
            self.sizer.observe(path)


def _hits(seq: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Where in ``seq`` the n-gram ``key`` (n,) occurs with at least one token after it."""
    n = key.shape[0]
    windows = seq.unfold(0, n, 1)[: seq.shape[0] - n]  # every n-gram that has a successor
    return torch.nonzero((windows == key).all(-1)).flatten()


def chain_marks(n: int) -> torch.Tensor:
    """``Draft.predicted`` of a chain of ``n`` tokens that all came from the prediction."""
    marks = torch.ones(n + 1, dtype=torch.bool)
    marks[0] = False  # the root is decided, not drafted
    return marks
