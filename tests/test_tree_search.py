"""Sparse trees from head accuracies: expected length, greedy construction, optimality."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from speculant.errors import ConfigError
from speculant.trees.buffers import build_tree, compile_paths, normalize_paths
from speculant.trees.search import expected_length, greedy_tree


def test_expected_length_by_hand():
    acc = [[0.8, 0.1], [0.5, 0.2]]
    assert expected_length([[0]], acc) == pytest.approx(0.8)
    assert expected_length([[0], [1], [0, 0], [0, 1], [1, 0]], acc) == pytest.approx(
        0.8 + 0.1 + 0.8 * 0.5 + 0.8 * 0.2 + 0.1 * 0.5)
    assert expected_length([], acc) == 0.0
    # a chain with perfect heads accepts everything
    assert expected_length([[0], [0, 0], [0, 0, 0]], [[1.0], [1.0], [1.0]]) == pytest.approx(3.0)


def test_obvious_trees():
    # head 0 is very sure, head 1 fairly: grow the rank-0 chain first, then widen
    acc = [[0.9, 0.05], [0.8, 0.1]]
    assert greedy_tree(acc, 1) == [[0]]
    assert greedy_tree(acc, 2) == [[0], [0, 0]]  # 0.72 beats [1] (0.05)
    assert greedy_tree(acc, 3) == [[0], [0, 0], [0, 1]]  # 0.09 beats 0.05
    assert greedy_tree(acc, 4) == [[0], [1], [0, 0], [0, 1]]
    # a useless second head and a flat first head: a wide single level
    assert greedy_tree([[0.3, 0.25, 0.2, 0.15], [0.01, 0.0, 0.0, 0.0]], 4) == [[0], [1], [2], [3]]
    # perfect rank-0 heads: a chain as deep as there are heads, then rank-1 siblings
    assert greedy_tree([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]], 3) == [[0], [0, 0], [0, 0, 0]]


def test_budget_larger_than_table():
    paths = greedy_tree([[0.5, 0.4], [0.5, 0.4]], 100)
    assert len(paths) == 2 + 4  # every node of the 2 x 2 table
    assert greedy_tree([[0.5]], 0) == []


def test_expected_length_monotone_and_trees_nested():
    g = torch.Generator().manual_seed(0)
    acc = torch.rand(4, 5, generator=g).sort(dim=1, descending=True).values * 0.9
    prev_len, prev_paths = 0.0, set()
    for budget in range(0, 40):
        paths = greedy_tree(acc, budget)
        assert len(paths) == budget
        compile_paths(paths)  # a valid tree spec
        assert json.loads(json.dumps(paths)) == paths  # JSON for --tree-file
        length = expected_length(paths, acc)
        assert length > prev_len or budget == 0
        assert prev_paths <= {tuple(p) for p in paths}
        prev_len, prev_paths = length, {tuple(p) for p in paths}


def _all_trees(K, R, size):
    """Every valid tree of ``size`` drafted nodes within depth K and ranks < R."""
    universe = [p for d in range(1, K + 1) for p in itertools.product(range(R), repeat=d)]
    for subset in itertools.combinations(universe, size):
        try:
            normalize_paths(subset)
        except ConfigError:
            continue
        yield subset


@pytest.mark.parametrize("seed", range(4))
def test_greedy_is_optimal_for_rank_monotone_accuracies(seed):
    g = torch.Generator().manual_seed(seed)
    acc = torch.rand(2, 3, generator=g).sort(dim=1, descending=True).values
    for size in range(1, 6):
        best = max(expected_length(t, acc) for t in _all_trees(2, 3, size))
        assert expected_length(greedy_tree(acc, size), acc) == pytest.approx(best)


def test_result_drives_a_medusa_tree():
    paths = greedy_tree([[0.7, 0.2, 0.1], [0.6, 0.3], [0.5]], 8)
    tree = build_tree(json.dumps(paths))
    assert tree.size == 9 and tree.depth <= 3
    # rows may be ragged: ranks without a measured accuracy are never used
    assert all(r < (3, 2, 1)[d] for p in paths for d, r in enumerate(p))
    assert len(greedy_tree([[0.7, 0.2], [0.6]], 100)) == 2 + 2


def test_bad_input():
    with pytest.raises(ConfigError, match="probabilities"):
        greedy_tree([[1.2]], 1)
    with pytest.raises(ConfigError, match="probabilities"):
        greedy_tree([[0.5, -0.1]], 1)
    with pytest.raises(ConfigError, match="probabilities"):
        greedy_tree(torch.tensor([[0.5, float("nan")]]), 1)
    with pytest.raises(ConfigError, match="K x R"):
        greedy_tree([0.5, 0.4], 1)
    with pytest.raises(ConfigError, match="budget"):
        greedy_tree([[0.5]], -1)
    with pytest.raises(ConfigError, match="deeper"):
        expected_length([[0], [0, 0]], [[0.5]])
    with pytest.raises(ConfigError, match="rank 2"):
        expected_length([[0], [1], [2]], [[0.5, 0.4]])
    with pytest.raises(ConfigError, match="rank 1"):
        expected_length([[0], [0, 0], [0, 1]], [[0.5, 0.4], [0.3]])
