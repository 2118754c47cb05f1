"""The proposer seam: a Drafter proposes a token tree, then observes what the target accepted.

Notation: the root (node 0) is the last decided token, not yet in the target's KV cache; every
other node is a drafted token. q is the draft distribution: ``Draft.q[i]`` is the distribution the
children of node i were drawn from (None for deterministic proposers such as n-gram lookup, whose
proposals are point masses).

What a drafter needs from the target is declared, not probed: ``hidden_need`` (a
:class:`HiddenNeed`) says which of the target's final hidden states the loop hands to ``begin``
and ``observe`` through their ``hidden`` argument (None when the drafter needs none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Protocol

import torch

from ..backends.base import Backend, ForwardOut, ForwardRequest, HiddenNeed
from ..tree import TreeBuffers, chain

__all__ = ["Draft", "Drafter", "HiddenNeed", "NoDrafter", "PassPlan", "drive"]


@dataclass(frozen=True)
class Draft:
    tree: TreeBuffers
    tokens: torch.Tensor  # (N,) long; tokens[0] = root; -1 marks an invalid (unfilled) node
    q: torch.Tensor | None = None  # (N, V) float32 draft distribution at each node, or None


# A proposal written as the model passes it needs: a generator that yields (backend, request) for
# each pass, is sent that pass's ForwardOut, and returns the Draft. A drafter that runs a model
# offers ``propose_passes(context) -> PassPlan`` beside ``propose``, so that the passes of several
# sequences' drafters can be run together (``batching``); ``drive`` runs one plan alone.
PassPlan = Generator[tuple[Backend, ForwardRequest], ForwardOut, "Draft"]


def drive(plan: PassPlan) -> "Draft":
    """Run a PassPlan's passes one by one on their backends; return its Draft."""
    try:
        backend, req = next(plan)
        while True:
            out = backend.forward(req.tokens, req.positions, req.tree_mask, req.rows, req.want_hidden)
            backend, req = plan.send(out)
    except StopIteration as stop:
        return stop.value


class Drafter(Protocol):
    """Proposes a token tree each step, then observes what the target accepted.

    ``hidden_need`` says what ``hidden`` holds in ``begin`` and ``observe``:

    NONE  always None.
    LAST  (H,) the target's final hidden state at the position before the next root: in ``begin``
          at ``prompt[-2]`` (None for a one-token prompt), in ``observe`` at ``path[-1]``.
    ALL   the states of every newly committed position: (T-1, H) for ``prompt[:-1]`` in ``begin``
          (None for a one-token prompt), (len(path), H) for the accepted path in ``observe``.
    """

    hidden_need: HiddenNeed

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        """Start a new sequence; ``prompt`` (T,) long."""

    def propose(self, context: torch.Tensor) -> Draft:
        """Propose a tree rooted at ``context[-1]``; ``context`` (L,) long is every token so far."""

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None = None) -> None:
        """The target accepted tree nodes ``path`` (root first) and then produced ``next_token``.
        A step verified without a proposal (``drafters.pacing``) observes ``path == [0]``."""


class NoDrafter:
    """Plain decoding: propose nothing, every step yields exactly one token from the target."""

    hidden_need = HiddenNeed.NONE

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        pass

    def propose(self, context: torch.Tensor) -> Draft:
        return Draft(chain(0), context[-1:].clone())

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None = None) -> None:
        pass
