"""How big a draft tree to verify at this step, given what a pass costs on this machine.

A dynamic tree (``dynamic_tree.DynamicTree``) lists its nodes best-first with scores s_i = log Π p along
each node's path: the heads' own estimate that the target accepts the whole path. A node is
accepted exactly when its path is, and one path is accepted, so the expected number of accepted
draft tokens of a tree is the sum of its nodes' acceptance probabilities. For the first m nodes
and c rows of the prompt-lookup chain hung below them:

    E(m, c) = 1 + κ · Σ_{i<m} exp(s_i) + Σ_{j=k+1}^{k+c} r_j        (k: chain tokens the first m nodes hold)
    T(m, c) = cost(1 + m + c, L) + overhead                         (ms; cost: costmodel.PassCost, L: context)

and :meth:`TreeSizer.choose` takes the (m, c) with the most expected tokens per millisecond,
E / T (the per-step rule of OPT-Tree, Wang et al. 2024, here with a measured cost curve). Where a
wider pass costs little (AMX) that is a wide tree; where it is compute-bound (AVX-512 without
AMX), a narrow one, and wider only when the heads are confident.

The estimates are kept honest online, with exponential forgetting (``decay`` per step) so they
follow the text: κ scales the heads' probabilities so that, summed with the chain's share, they
predict the accepted tokens actually seen (heads are overconfident deeper down); r_j is the
observed rate at which the chain's first j tokens were all accepted when it offered at least j;
``overhead`` is the drafting time per step. None of this can change the output: the target still
verifies every token, so the choice only moves speed.
"""

from __future__ import annotations

import math

from .costmodel import PassCost

__all__ = ["TreeSizer"]


class TreeSizer:
    """Per-step choice of the tree's size against a measured pass-cost curve (see module doc).

    cost: the target's pass cost by rows. max_rows: never verify more rows than this (the root
    included). chain_prior: the prior r_1 of the lookup chain (r_j prior: chain_prior ** j);
    prior_weight: how many steps' worth of evidence a prior counts for; decay: forgetting per step.
    """

    def __init__(self, cost: PassCost, max_rows: int | None = None, chain_prior: float = 0.5,
                 prior_weight: float = 2.0, decay: float = 0.98):
        self.cost = cost
        self.max_rows = max_rows
        self.chain_prior, self.prior_weight, self.decay = chain_prior, prior_weight, decay
        self.hits: list[float] = []  # per chain position j (0-based): decayed count of "first j+1 accepted"
        self.offered: list[float] = []  # ... of "the tree held at least j+1 chain tokens"
        self.heads_pred = 0.0  # decayed Σ of the heads' raw predicted accepted tokens
        self.heads_seen = 0.0  # decayed Σ (accepted tokens − the chain rows' predicted share)
        self.overhead_ms = 0.0  # drafting time per step (EMA)
        self.last_choice: tuple[int, int] | None = None
        self._pending: tuple[list[int], list[int], float, float] | None = None
        self.others_rows, self.others_tokens = 0, 0.0  # what other sequences put in the same pass

    def fork(self) -> "TreeSizer":
        """A sizer for another sequence: the same cost curve and settings, a copy of the estimates
        learned so far (each sequence then learns its own)."""
        other = TreeSizer(self.cost, self.max_rows, self.chain_prior, self.prior_weight, self.decay)
        other.hits, other.offered = list(self.hits), list(self.offered)
        other.heads_pred, other.heads_seen, other.overhead_ms = self.heads_pred, self.heads_seen, self.overhead_ms
        return other

    def share(self, rows: int, tokens: float) -> None:
        """Other sequences put ``rows`` rows into the next pass and expect ``tokens`` tokens from
        it (``batching``): the tree is then sized for the whole pass's tokens per millisecond,
        (E + tokens) / cost(rows + own rows)."""
        self.others_rows, self.others_tokens = max(int(rows), 0), max(float(tokens), 0.0)

    # ---- estimates -------------------------------------------------------------------------
    @property
    def kappa(self) -> float:
        """The heads' calibration factor (1 with no evidence), kept in [0.2, 2]."""
        w = self.prior_weight
        return min(max((self.heads_seen + w) / (self.heads_pred + w), 0.2), 2.0)

    def worth_deeper(self, front_scores: list[float], depth_ms: float, context: int | None = None,
                     rows: int = 1) -> bool:
        """Whether drafting one more depth below nodes of these log-scores can pay for its
        ``depth_ms``. A node's children are together accepted no more often than it is (at most
        exp(score), calibrated by ``kappa``); an accepted token is worth at most one single-row pass
        (what plain decoding pays); and verifying any of them takes at least one more row after the
        ``rows`` the tree needs already (the root and one node per depth drafted), at the cost
        curve's price for that row. So the depth can return at most Σ max(0, p·value − row) over
        the front, which must exceed its drafting time."""
        base = self.others_rows
        value = self.cost(1 + base, context)
        row = max(self.cost(base + rows + 1, context) - self.cost(base + rows, context), 0.0)
        gain = sum(max(self.kappa * math.exp(min(s, 0.0)) * value - row, 0.0) for s in front_scores)
        return gain > depth_ms

    def chain_rates(self, n: int) -> list[float]:
        """r_1..r_n: the chance that the chain's first j tokens are all accepted (non-increasing)."""
        out, low = [], 1.0
        for j in range(n):
            prior = self.chain_prior ** (j + 1)
            hit = self.hits[j] if j < len(self.hits) else 0.0
            off = self.offered[j] if j < len(self.offered) else 0.0
            low = min(low, (hit + self.prior_weight * prior) / (off + self.prior_weight))
            out.append(low)
        return out

    # ---- the choice --------------------------------------------------------------------------
    def choose(self, scores: list[float], walk: list[int], n_chain: int,
               context: int | None = None) -> tuple[int, int]:
        """scores: the best-first nodes' log-scores; walk: the positions (in that list, increasing)
        of the nodes holding the chain's first tokens; n_chain: the chain's length; context: the
        tokens the pass will attend to (the cost grows with them). Returns (m, c): verify the
        first m nodes and c chain rows after the tokens they hold."""
        kappa = self.kappa
        r = self.chain_rates(n_chain)
        prefix = [0.0]
        for s in scores:
            prefix.append(prefix[-1] + math.exp(min(s, 0.0)))
        r_prefix = [0.0]
        for x in r:
            r_prefix.append(r_prefix[-1] + x)
        cap = 1 + len(scores) + n_chain
        cap = min(cap, self.max_rows) if self.max_rows is not None else cap
        base, others = self.others_rows, self.others_tokens
        time_of = [0.0] + [self.cost(base + rows, context) + self.overhead_ms for rows in range(1, cap + 1)]
        best, best_rate = (0, 0), -1.0
        k = 0  # chain tokens held by the first m nodes
        for m in range(len(scores) + 1):
            while k < len(walk) and walk[k] < m:
                k += 1
            heads = 1.0 + kappa * prefix[m]
            for c in range(n_chain - k + 1):
                rows = 1 + m + c
                if rows > cap:
                    break
                rate = (others + heads + r_prefix[k + c] - r_prefix[k]) / time_of[rows]
                if rate > best_rate + 1e-12:
                    best, best_rate = (m, c), rate
        self.last_choice = best
        return best

    def drafted(self, tokens, chain_tokens: list[int], head_scores: list[float]) -> None:
        """The tree just built: all its tokens (root first), the chain tokens it holds (heads'
        nodes or rows, in chain order) and the chosen heads' nodes' log-scores."""
        r = self.chain_rates(len(chain_tokens))
        k = self.last_choice
        # the chain rows' predicted share: positions past the tokens the heads' nodes hold
        held = len(chain_tokens) - (k[1] if k is not None else 0)
        chain_pred = sum(r[held:])
        heads_pred = sum(math.exp(min(s, 0.0)) for s in head_scores)
        self._pending = (tokens.tolist() if hasattr(tokens, "tolist") else list(tokens), list(chain_tokens),
                         heads_pred, chain_pred)

    def observe(self, path: list[int]) -> None:
        """The accepted path (node ids, root first) of the tree :meth:`drafted` described."""
        if self._pending is None:
            return
        tokens, chain_tokens, heads_pred, chain_pred = self._pending
        self._pending = None
        accepted = [tokens[i] for i in path[1:]]
        g = self.decay
        self.heads_pred = g * self.heads_pred + heads_pred
        self.heads_seen = g * self.heads_seen + max(len(accepted) - chain_pred, 0.0)
        n = len(chain_tokens)
        while len(self.offered) < n:
            self.offered.append(0.0)
            self.hits.append(0.0)
        same = 0
        while same < min(n, len(accepted)) and accepted[same] == chain_tokens[same]:
            same += 1
        for j in range(len(self.offered)):
            self.offered[j] *= g
            self.hits[j] *= g
        for j in range(n):
            self.offered[j] += 1.0
            if j < same:
                self.hits[j] += 1.0

    def drafting_took(self, ms: float) -> None:
        """Fold one step's drafting time into the overhead estimate."""
        self.overhead_ms = ms if self.overhead_ms == 0.0 else 0.8 * self.overhead_ms + 0.2 * ms
