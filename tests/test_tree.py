"""Tree specs compiled to buffers: masks, depths, parents, children, retrieve indices."""

import pytest
import torch

from speculant.errors import ConfigError
from speculant.trees.buffers import build_tree, chain, kconfig_paths, parse_tree_spec


def test_mask_lets_each_node_see_exactly_its_ancestors():
    t = build_tree([[0], [1], [0, 0], [0, 1]])
    assert t.paths == ((), (0,), (1,), (0, 0), (0, 1))
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(t.mask, expected)
    assert t.parents.tolist() == [-1, 0, 0, 1, 1]
    assert t.depths.tolist() == [0, 1, 1, 2, 2]
    assert t.ranks.tolist() == [0, 0, 1, 0, 1]
    assert t.children.tolist() == [[1, 2], [3, 4], [-1, -1], [-1, -1], [-1, -1]]
    assert [lv.tolist() for lv in t.levels] == [[0], [1, 2], [3, 4]]
    assert t.retrieve.tolist() == [[0, 2, -1], [0, 1, 3], [0, 1, 4]]
    assert (t.depth, t.fanout(0), t.fanout(1), t.fanout(2)) == (2, 2, 2, 0)


def test_mask_is_ancestor_relation_for_random_sparse_tree():
    t = build_tree("[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0],[2,0],[2,0,0]]")
    for i in range(t.size):
        anc, j = set(), i
        while j >= 0:
            anc.add(j)
            j = int(t.parents[j])
        assert set(torch.nonzero(t.mask[i]).flatten().tolist()) == anc
        assert int(t.depths[i]) == len(anc) - 1


def test_chain_and_kconfig():
    c = chain(3)
    assert c.paths == ((), (0,), (0, 0), (0, 0, 0))
    assert torch.equal(c.mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert chain(0).size == 1 and chain(0).depth == 0
    t = build_tree("4x2x2x1")
    assert [len(lv) for lv in t.levels] == [1, 4, 8, 16, 16]
    assert t.size == 45 and t.depth == 4
    assert [t.fanout(d) for d in range(5)] == [4, 2, 2, 1, 0]
    assert len(kconfig_paths([2, 3])) == 2 + 6
    assert build_tree("5").paths == chain(5).paths  # a bare integer is a chain
    assert parse_tree_spec("2X2") == parse_tree_spec("2x2")


def test_nodes_breadth_first_and_parent_precedes_child():
    t = build_tree("3x2x2")
    assert (t.parents[1:] < torch.arange(1, t.size)).all()
    assert (t.depths[1:] >= t.depths[:-1]).all()


@pytest.mark.parametrize("spec, msg", [
    ("4x", "malformed"), ("ax2", "malformed"), ("4x0", ">= 1"), ("[[0],[2]]", "skips rank"),
    ("[[0,0]]", "no parent"), ("[[0], [-1]]", ">= 0"), ("[[0],", "not valid JSON"), ('{"a": 1}', "JSON list"),
    ("[1, 2]", "not a list"), ("[]", "no nodes"), ("0", ">= 1"), ([[0], ["a"]], ">= 0"),
])
def test_malformed_specs_are_clear_errors(spec, msg):
    with pytest.raises(ConfigError, match=msg):
        build_tree(spec)
