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

from typing import Any, Generator, Hashable, NamedTuple, Protocol, Sequence

import torch

from ..backends.base import Backend, ForwardOut, ForwardRequest, HiddenNeed, forward_batch
from ..trees.buffers import chain
from ..trees.draft import Draft

__all__ = ["Drafter", "HiddenNeed", "Job", "ModelPass", "NoDrafter", "PassPlan", "ProposesAlone", "drive"]


class Job(Protocol):
    """One piece of a drafter's step that the drafters of several sequences can do together (one
    read of the weights for all of them): jobs with equal ``together`` keys run as ONE call of
    ``run_together(jobs)``, which returns each job's output, in order, each what the job gives
    alone (up to the low-order bits of kernels that are not row-invariant: drafts only, never the
    output, which the target verifies)."""

    @property
    def together(self) -> Hashable: ...

    @staticmethod
    def run_together(jobs: Sequence["Job"]) -> list[Any]: ...


class ModelPass(NamedTuple):
    """A Job: one pass of a draft model for one sequence (``Backend.forward``'s arguments). Passes
    of several sequences run as one ``forward_batch``."""
    backend: Backend
    request: ForwardRequest

    @property
    def together(self) -> Hashable:
        return "model-pass"

    @staticmethod
    def run_together(jobs: Sequence["ModelPass"]) -> list[ForwardOut]:
        return forward_batch([j.backend for j in jobs], [j.request for j in jobs])


# A proposal written as the jobs it needs: a generator that yields a Job (a draft model's pass, a
# call of the heads), is sent that job's output, and returns the Draft. A drafter whose step does
# such work offers ``propose_passes(context) -> PassPlan`` beside ``propose``, so that the work of
# several sequences' drafters can be done together (``batching``); ``drive`` runs one plan alone.
PassPlan = Generator[Job, Any, "Draft"]


def drive(plan: PassPlan) -> "Draft":
    """Run a PassPlan's jobs one by one, each alone; return its Draft."""
    try:
        job = next(plan)
        while True:
            job = plan.send(job.run_together([job])[0])
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

    ``hidden_layers``: the target layers whose input states follow the final one in each of those
    rows (``backends.base.ForwardRequest.layers``), so H above is H (1 + len(hidden_layers)); () for
    the final state alone.
    """

    hidden_need: HiddenNeed
    hidden_layers: tuple[int, ...]
    sizer: Any  # tuning.sizing.TreeSizer sizing its trees against the pass cost, or None
    # Optional: ``topk_need`` k > 0 asks the loop for the target's top-k next tokens after every
    # verified node: ``observe_pass(node_tokens (N,) long, topk (N, k) long)``, called once per
    # pass before ``observe``, at no extra target cost (drafters.recycling). ``finish(context)``:
    # the generation ended with ``context`` (L,) (drafters.suffix keeps the answer).

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        """Start a new sequence; ``prompt`` (T,) long."""

    def propose(self, context: torch.Tensor) -> Draft:
        """Propose a tree rooted at ``context[-1]``; ``context`` (L,) long is every token so far."""

    def propose_passes(self, context: torch.Tensor) -> PassPlan:
        """``propose`` as a :data:`PassPlan` of the jobs its step needs (none for a drafter whose
        step is one call of its own: :class:`ProposesAlone`)."""

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None = None) -> None:
        """The target accepted tree nodes ``path`` (root first) and then produced ``next_token``.
        A step verified without a proposal (``tuning.pacing``) observes ``path == [0]``."""


class ProposesAlone:
    """For a drafter whose step shares no work with other sequences' drafters: its
    ``propose_passes`` is ``propose`` (a plan without jobs), and it sizes no trees by default."""

    sizer = None

    def propose_passes(self, context: torch.Tensor) -> PassPlan:
        return self.propose(context)
        yield  # a generator: the plan ends at once with the Draft


class NoDrafter(ProposesAlone):
    """Plain decoding: propose nothing, every step yields exactly one token from the target."""

    hidden_need = HiddenNeed.NONE
    hidden_layers = ()

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        pass

    def propose(self, context: torch.Tensor) -> Draft:
        return Draft(chain(0), context[-1:].clone())

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None = None) -> None:
        pass
