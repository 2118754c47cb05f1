r"""Sparse trees from head accuracies (the Medusa construction).

``acc[h][i]`` = P(head h's i-th ranked token is the right one), h < K heads, i < R ranks, measured
on calibration data. A tree node with path ``(r_1, ..., r_d)`` holds head (d−1)'s ``r_d``-th token
(see ``speculant.drafters.static_tree``), and it is accepted iff every token on its path is right.
Assuming the heads are right independently, P(node accepted) = Π_j acc[j−1][r_j]. Siblings hold
distinct tokens, so at most one child of a node can be accepted, and the number of accepted draft
tokens of a step is the number of accepted nodes; hence

    E[accepted draft tokens per step] = Σ_{nodes ≠ root} Π_j acc[j−1][r_j]

and the expected tokens per target call is τ ≈ 1 + that (one target token per step).

:func:`greedy_tree` adds, one at a time, the node that most increases this sum, among the nodes
the tree format allows next (a child of an existing node — or of the root — with the next free
rank: ranks have no gaps). When each head's accuracies are non-increasing in rank (the usual case:
rank by the head's own logits) every candidate is worth no more than its parent and its lower
-ranked sibling, so the n most valuable nodes form a valid tree and the greedy tree of n nodes is
optimal; the trees for growing budgets are nested.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import torch

from ..errors import ConfigError
from .buffers import Path, normalize_paths

__all__ = ["as_accuracies", "expected_length", "greedy_tree"]


def as_accuracies(acc: Sequence[Sequence[float]] | torch.Tensor) -> torch.Tensor:
    """Validate ``acc`` -> float64 (K, R) tensor of probabilities in [0, 1].

    Rows may have different lengths (ranks not measured for a head); the missing entries come
    back as -1 and mark ranks that no tree node may use.
    """
    bad = ConfigError("head accuracies must be a K x R table of numbers (acc[h][i]: head h, rank i)")
    if isinstance(acc, torch.Tensor):
        t = acc.detach().to(torch.float64)
        if t.dim() != 2:
            raise ConfigError(f"head accuracies must be a K x R table, got shape {tuple(t.shape)}")
        if not bool(((t >= 0) & (t <= 1)).all()):
            raise ConfigError("head accuracies are probabilities: every acc[h][i] must be in [0, 1]")
    else:
        try:
            rows = [[float(x) for x in row] for row in acc]
        except (TypeError, ValueError):
            raise bad from None
        if any(not r for r in rows):
            raise ConfigError("head accuracies: every head needs the accuracy of at least its rank-0 token")
        if any(not 0 <= x <= 1 for r in rows for x in r):
            raise ConfigError("head accuracies are probabilities: every acc[h][i] must be in [0, 1]")
        width = max((len(r) for r in rows), default=0)
        t = torch.tensor([r + [-1.0] * (width - len(r)) for r in rows], dtype=torch.float64).view(len(rows), width)
    if t.shape[0] < 1 or t.shape[1] < 1:
        raise ConfigError(f"head accuracies must be a non-empty K x R table, got shape {tuple(t.shape)}")
    return t


def _node_value(path: Path, acc: torch.Tensor) -> float:
    value = 1.0
    for d, r in enumerate(path):
        value *= float(acc[d, r])
    return value


def expected_length(paths: Sequence[Sequence[int]], acc: Sequence[Sequence[float]] | torch.Tensor) -> float:
    """Expected accepted draft tokens per step of the tree ``paths`` (root excluded)."""
    a = as_accuracies(acc)
    K, R = a.shape
    total = 0.0
    for p in normalize_paths(paths) if paths else ():
        if len(p) > K:
            raise ConfigError(f"tree path {list(p)} is deeper than the {K} heads the accuracies cover")
        bad = [r for d, r in enumerate(p) if r >= R or a[d, r] < 0]
        if bad:
            raise ConfigError(f"tree path {list(p)} uses rank {bad[0]}, for which the accuracies have no value")
        total += _node_value(p, a)
    return total


def greedy_tree(acc: Sequence[Sequence[float]] | torch.Tensor, budget: int) -> list[list[int]]:
    """The tree of ``budget`` drafted nodes (root excluded) built greedily from ``acc`` (K, R).

    Returns the paths breadth-first (as ``trees.buffers.normalize_paths`` orders them), ready for
    ``trees.buffers.compile_paths`` or ``json.dump`` (``--tree-file``). Fewer than ``budget`` nodes when
    the K x R table allows no more (at most Σ_d R^d). Ties go to the shallower node, then the
    lexicographically smaller path.
    """
    a = as_accuracies(acc)
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise ConfigError(f"tree node budget must be an integer >= 0, got {budget!r}")
    K, R = a.shape
    chosen: list[Path] = []
    # frontier: one candidate per node that may still get a child — its next free rank
    heap: list[tuple[float, int, Path]] = []

    def push(path: Path) -> None:
        if len(path) <= K and path[-1] < R and a[len(path) - 1, path[-1]] >= 0:
            heapq.heappush(heap, (-_node_value(path, a), len(path), path))

    push((0,))
    while heap and len(chosen) < budget:
        _, _, path = heapq.heappop(heap)
        chosen.append(path)
        push(path + (0,))  # its first child
        push(path[:-1] + (path[-1] + 1,))  # its next sibling
    return [list(p) for p in normalize_paths(chosen)] if chosen else []
