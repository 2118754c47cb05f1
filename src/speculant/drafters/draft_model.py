"""A small draft model proposing a chain (SD, γ tokens) or a k-config tree (MCSD).

The draft runs one forward pass per tree depth: the first pass feeds the context tokens it has
not cached yet (at least the root) and yields q at the root; pass d feeds every node of depth d
at once under the tree mask and yields q at each of them. Children are the top-k of q when
greedy, else k samples from q (with or without replacement). The last depth is never fed: its
KV is only needed if accepted, and then it is fed with the next step's first pass.

With a grammar ``constraint`` (``constraints.Constraint``) each node's draft logits are masked with
the grammar state after its path before its children are chosen, so q is the masked draft
distribution the candidates are drawn from: drafts the grammar refuses are never proposed (the
output is the same either way; acceptance is higher).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..backends.base import Backend, ForwardRequest
from ..config import SamplingConfig
from ..sampling import logits_to_probs, sample_candidates, topk_candidates
from ..trees.buffers import TreeBuffers
from ..trees.draft import Draft
from .base import HiddenNeed, ModelPass, PassPlan, drive

if TYPE_CHECKING:
    from ..constraints import Constraint


class DraftModelDrafter:
    hidden_need = HiddenNeed.NONE  # the draft model keeps its own cache
    hidden_layers = ()
    sizer = None  # its chain or tree has a fixed size

    def __init__(self, backend: Backend, tree: TreeBuffers, sampling: SamplingConfig,
                 vocab_size: int, *, replacement: bool = True, generator: torch.Generator | None = None,
                 constraint: Constraint | None = None):
        self.backend, self.tree, self.sampling = backend, tree, sampling
        self.constraint = constraint  # the generation's grammar (read only: the loop commits it)
        self.V = vocab_size  # common vocabulary of draft and target (logits are cut to it)
        self.replacement = replacement
        self.generator = generator
        self.committed = 0  # context tokens whose KV is in the draft cache
        self._context_len = 0
        self._proposed = False  # a tree of this step is in the draft cache (observe compacts it)

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        self.backend.reset()
        self.committed = 0

    def _children(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits (m, V) -> candidates (m, k) and q (m, V) (None when greedy)."""
        if self.sampling.greedy:
            return topk_candidates(logits, k), None
        q = logits_to_probs(logits, self.sampling)
        return sample_candidates(q, k, replacement=self.replacement, generator=self.generator), q

    def propose(self, context: torch.Tensor) -> Draft:
        return drive(self.propose_passes(context))

    def propose_passes(self, context: torch.Tensor) -> PassPlan:
        """``propose`` as its draft-model passes: yields a ModelPass for each depth and is
        sent each pass's output, so that several sequences' drafters can share passes
        (``batching``); returns the Draft."""
        tree = self.tree
        N, L = tree.size, context.shape[0]
        tokens = torch.full((N,), -1, dtype=torch.long)
        tokens[0] = context[-1]
        q = None if self.sampling.greedy else torch.zeros(N, self.V)
        self.backend.rollback(self.committed)
        pending = context[self.committed:]
        out = yield ModelPass(self.backend,
                              ForwardRequest(pending, rows=torch.tensor([pending.shape[0] - 1]), prefill=True))
        logits = out.logits[:, :self.V]
        self.committed = L
        self._context_len = L
        self._proposed = True
        for d in range(tree.depth):
            parents = tree.levels[d]  # (m,) nodes of depth d
            if d > 0:
                new = tree.levels[d]
                seen = tree.mask[new][:, 1:int(new[-1]) + 1]  # (m, nodes of depth 1..d)
                out = yield ModelPass(self.backend,
                                      ForwardRequest(tokens[new].clamp(min=0), L - 1 + tree.depths[new], seen))
                logits = out.logits[:, :self.V]
            if self.constraint is not None:
                logits = self.constraint.mask_nodes(logits, tree, tokens, parents)
            k = tree.fanout(d)
            cands, qd = self._children(logits, k)  # (m, k)
            if qd is not None:
                q[parents] = qd
            kids = tree.children[parents, :k]  # (m, k) node ids or -1
            valid = kids >= 0
            tokens[kids[valid]] = cands[valid]
        return Draft(tree, tokens, q)

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None = None) -> None:
        if not self._proposed:  # a step verified without this drafter's tree: nothing to compact
            return
        self._proposed = False
        # The cache holds the context, then tree nodes of depth 1 .. D-1 in node order.
        fed = [node for node in path[1:] if int(self.tree.depths[node]) < self.tree.depth]
        self.backend.compact(self._context_len, torch.tensor(fed, dtype=torch.long) - 1)
        self.committed = self._context_len + len(fed)
