"""The proposer seam: a Drafter proposes a token tree, then observes what the target accepted.

Notation: the root (node 0) is the last decided token, not yet in the target's KV cache; every
other node is a drafted token. q is the draft distribution: ``Draft.q[i]`` is the distribution the
children of node i were drawn from (None for deterministic proposers such as n-gram lookup, whose
proposals are point masses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..tree import TreeBuffers, chain


@dataclass(frozen=True)
class Draft:
    tree: TreeBuffers
    tokens: torch.Tensor  # (N,) long; tokens[0] = root; -1 marks an invalid (unfilled) node
    q: torch.Tensor | None = None  # (N, V) float32 draft distribution at each node, or None


class Drafter(Protocol):
    """Optional attribute ``needs_hidden: bool``: if True, ``begin`` and ``observe`` also get
    ``hidden=`` (H,), the target's final hidden state at the node before the next root. With
    ``needs_all_hidden`` also True they get the states of every newly committed position instead:
    (T-1, H) for the prompt's prefill in ``begin``, (len(path), H) for the accepted path in ``observe``."""

    def begin(self, prompt: torch.Tensor) -> None:
        """Start a new sequence; ``prompt`` (T,) long."""

    def propose(self, context: torch.Tensor) -> Draft:
        """Propose a tree rooted at ``context[-1]``; ``context`` (L,) long is every token so far."""

    def observe(self, path: list[int], next_token: int) -> None:
        """The target accepted tree nodes ``path`` (root first) and then produced ``next_token``."""


class NoDrafter:
    """Plain decoding: propose nothing, every step yields exactly one token from the target."""

    def begin(self, prompt: torch.Tensor) -> None:
        pass

    def propose(self, context: torch.Tensor) -> Draft:
        return Draft(chain(0), context[-1:].clone())

    def observe(self, path: list[int], next_token: int) -> None:
        pass
