"""Penalties and logit bias on the target's logits at every verified node, exact under speculation.

A request may ask for OpenAI's ``presence_penalty`` and ``frequency_penalty``, a
``repetition_penalty`` (CTRL's, as transformers applies it) and a ``logit_bias``. They change the
distribution decoding samples from, so speculative decoding must reproduce the *penalised*
target distribution: the row of node i (the target's output after node i) is penalised for the
tokens up to and including node i — the committed context, then the drafted tokens of node i's
own path. Every entry is computed by one elementwise function of (the raw logit, the token's count,
whether it was seen), so a node's row has exactly the bits a one-token step would give it once
that path is committed: greedy output equals plain decoding's with the same penalties, and
sampling follows the penalised target distribution (the draft's q needs no penalty for that:
speculative sampling is exact for any q the candidates were drawn from).

For each token t of the vocabulary, with c the number of times t occurs in the generated text so
far (prompt excluded) and "seen" whether t occurs in the prompt or the generated text:

    l'  = (l / r if l > 0 else l * r) if seen else l          repetition_penalty r (1: off)
    l'' = l' - frequency_penalty * c - presence_penalty * [c > 0] + logit_bias[t]

as vLLM and transformers order them (repetition first, then the OpenAI penalties, then the bias).

Shapes: N tree nodes (node 0 the root, the last committed token), V vocabulary, L context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import ConfigError
from .trees.buffers import TreeBuffers

__all__ = ["Penalties", "penalise"]

MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
MAX_REPETITION_PENALTY = 100.0  # repetition penalties lie in (0, MAX_REPETITION_PENALTY]
MAX_BIAS = 100.0  # logit biases lie in [-MAX_BIAS, MAX_BIAS] (OpenAI's range)


@dataclass(frozen=True)
class Penalties:
    """``presence`` / ``frequency``: OpenAI's penalties, in [-2, 2]; ``repetition``: > 0, 1 off;
    ``logit_bias``: (token id, bias in [-100, 100]) pairs."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not -MAX_PENALTY <= float(value) <= MAX_PENALTY:
                raise ConfigError(f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}, got {value}")
        if not 0.0 < float(self.repetition) <= MAX_REPETITION_PENALTY:
            raise ConfigError(f"repetition_penalty must be > 0 and <= {MAX_REPETITION_PENALTY:g} (1: off), got "
                              f"{self.repetition}")
        for tok, bias in self.logit_bias:
            if int(tok) < 0:
                raise ConfigError(f"logit_bias token ids must be >= 0, got {tok}")
            if not -MAX_BIAS <= float(bias) <= MAX_BIAS:
                raise ConfigError(f"logit_bias values must be between -{MAX_BIAS:g} and {MAX_BIAS:g}, got {bias} for "
                                  f"token {tok}")

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.logit_bias)

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t, _ in self.logit_bias if int(t) >= vocab_size]
        if bad:
            raise ConfigError(f"logit_bias names token id {bad[0]}, outside the vocabulary (ids 0 to {vocab_size - 1})")


def _adjust(logits: Tensor, counts: Tensor, seen: Tensor, bias: Tensor, p: Penalties) -> Tensor:
    """The elementwise rule of the module doc: float32 logits, counts (float32), seen (bool),
    bias (float32), all broadcastable to one shape."""
    out = logits
    if p.repetition != 1.0:
        r = torch.tensor(p.repetition, dtype=torch.float32)
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if p.frequency:
        out = out - torch.tensor(p.frequency, dtype=torch.float32) * counts
    if p.presence:
        out = out - torch.tensor(p.presence, dtype=torch.float32) * (counts > 0).float()
    if p.logit_bias:
        out = out + bias
    return out


def penalise(logits: Tensor, p: Penalties, context: Tensor, prompt_len: int, tree: TreeBuffers,
             tokens: Tensor) -> Tensor:
    """The penalised rows of a verification pass: ``logits`` (N, V) the target's rows for the
    tree's nodes, ``context`` (L,) long the committed tokens (its first ``prompt_len`` the
    prompt; the root is ``context[-1]``), ``tree`` and ``tokens`` (N,) long the drafted tree.
    Returns float32 (N, V)."""
    N, V = logits.shape
    logits = logits.float()
    generated = context[prompt_len:]
    counts = torch.bincount(generated, minlength=V)[:V].float()  # (V,)
    seen = torch.zeros(V, dtype=torch.bool)
    if p.repetition != 1.0:
        seen[context[context < V]] = True
    bias = torch.zeros(V, dtype=torch.float32)
    for tok, b in p.logit_bias:
        if int(tok) < V:
            bias[int(tok)] = float(b)
    out = _adjust(logits, counts[None], seen[None], bias[None], p)  # (N, V): the committed context's
    if N == 1:
        return out
    # node i's own drafted path changes its row at the tokens of that path only
    parents = tree.parents.tolist()
    toks = tokens.tolist()
    for i in range(1, N):
        path, j = [], i
        while j > 0:
            path.append(toks[j])
            j = parents[j]
        extra: dict[int, int] = {}
        for t in path:
            if 0 <= t < V:
                extra[t] = extra.get(t, 0) + 1
        if not extra:
            continue
        cols = torch.tensor(list(extra), dtype=torch.long)
        c = counts[cols] + torch.tensor(list(extra.values()), dtype=torch.float32)
        out[i, cols] = _adjust(logits[i, cols], c, torch.ones_like(cols, dtype=torch.bool), bias[cols], p)
    return out
