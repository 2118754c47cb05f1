"""Approximate acceptance rules on hand-built logits: typical (Medusa), top-k, distance and
minimum block (BPD), plus prefix lengths and the longest accepted tree path."""

from __future__ import annotations

import math

import pytest
import torch

from speculant.acceptance import (accept_tree_approx, accepted_prefix, best_path, distance_accept, entropy, greedy_accept,
                                  min_block, topk_accept, typical_accept, typical_threshold)
from speculant.config import AcceptanceConfig, SamplingConfig, parse_acceptance
from speculant.errors import ConfigError
from speculant.sampling import logits_to_probs
from speculant.trees.buffers import build_tree


def probs(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_entropy():
    p = probs([1, 0, 0, 0], [0.25] * 4, [0.5, 0.5, 0, 0])
    torch.testing.assert_close(entropy(p), torch.tensor([0.0, math.log(4), math.log(2)]))


def test_typical_threshold_is_min_of_eps_and_entropy_term():
    p = probs([0.25] * 4, [0.97, 0.01, 0.01, 0.01])
    thr = typical_threshold(p, eps=0.09, delta=0.3)
    # uniform: 0.3 * exp(-ln 4) = 0.075 < 0.09; peaked: 0.3 * exp(-small) > 0.09 -> 0.09
    torch.testing.assert_close(thr, torch.tensor([0.075, 0.09]))


def test_typical_accept_hand_built():
    p = probs([0.25] * 4, [0.97, 0.01, 0.01, 0.01], [0.6, 0.3, 0.1, 0.0])
    cands = torch.tensor([[0, 3, -1], [0, 1, 2], [1, 2, 3]])
    got = typical_accept(p, cands, eps=0.09, delta=0.3)
    # row 0: 0.25 > 0.075 everywhere; -1 invalid. row 1: only 0.97 > 0.09.
    # row 2: H = 0.898 nats, threshold min(0.09, 0.3 * 0.407 = 0.122) = 0.09 -> 0.3 and 0.1 pass, 0.0 fails
    assert got.tolist() == [[True, True, False], [True, False, False], [True, True, False]]


def test_typical_at_temperature_zero_is_greedy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 50, generator=g)
    logits[0, 7] = logits[0, 3] = logits[0].max() + 1  # a tie: greedy keeps the lower id
    cands = torch.randint(0, 50, (32, 6), generator=g)
    cands[:, 0] = logits.argmax(-1)
    cands[1, 1] = 7
    p = logits_to_probs(logits, SamplingConfig(temperature=0.0))  # one-hot of the argmax
    for eps, delta in [(0.09, 0.3), (0.5, 5.0), (0.999, 0.01)]:
        got = typical_accept(p, cands, eps, delta)
        assert torch.equal(got, cands == logits.argmax(-1, keepdim=True))
        first = torch.where(got.any(1), got.to(torch.int8).argmax(1), -1)
        assert torch.equal(first, greedy_accept(logits.argmax(-1), cands))


def test_typical_bad_parameters():
    p = probs([1, 0])
    c = torch.tensor([[0]])
    for eps in (0.0, 1.0, 1.5):
        with pytest.raises(ConfigError, match="eps"):
            typical_accept(p, c, eps=eps, delta=0.3)
    with pytest.raises(ConfigError, match="delta"):
        typical_accept(p, c, eps=0.1, delta=0.0)
    with pytest.raises(ValueError, match="candidates"):
        typical_accept(p, torch.tensor([0]))


def test_topk_accept():
    logits = torch.tensor([[0.0, 5.0, 3.0, 4.0, 1.0],
                           [2.0, 2.0, 2.0, 0.0, 1.0]])  # row 1: a three-way tie
    cands = torch.tensor([[1, 3, 2, 4, -1], [0, 1, 2, 4, 3]])
    assert topk_accept(logits, cands, 1).tolist() == [[True, False, False, False, False],
                                                     [True, False, False, False, False]]
    assert topk_accept(logits, cands, 2).tolist() == [[True, True, False, False, False],
                                                     [True, True, False, False, False]]
    assert topk_accept(logits, cands, 3).tolist() == [[True, True, True, False, False],
                                                     [True, True, True, False, False]]
    assert topk_accept(logits, cands, 5)[:, :4].all() and not topk_accept(logits, cands, 5)[0, 4]
    g = torch.Generator().manual_seed(1)
    big = torch.randn(16, 40, generator=g)
    c = torch.randint(0, 40, (16, 3), generator=g)
    assert torch.equal(topk_accept(big, c, 1), c == big.argmax(-1, keepdim=True))  # k = 1 is greedy
    with pytest.raises(ConfigError, match="k_top"):
        topk_accept(logits, cands, 0)


def test_distance_accept():
    emb = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [0.3, 0.4], [0.0, 0.0]])
    argmax = torch.tensor([0, 1])
    cands = torch.tensor([[0, 3, 1, 2, 4, -1], [1, 3, 0, 2, 4, 9]])
    # distances to token 0: 0, 0.5, 1, 2, 0 (a duplicate embedding), invalid
    assert distance_accept(emb, argmax, cands, 0.5).tolist()[0] == [True, True, False, False, True, False]
    assert distance_accept(emb, argmax, cands, 0.0).tolist()[0] == [True, False, False, False, True, False]
    # distances to token 1: 0, |(-0.7, 0.4)| = 0.806, 1, sqrt(5), 1; 9 is out of the vocabulary
    assert distance_accept(emb, argmax, cands, 1.0).tolist()[1] == [True, True, True, False, True, False]
    with pytest.raises(ConfigError, match="eps"):
        distance_accept(emb, argmax, cands, -1.0)


def test_min_block_and_prefix():
    acc = torch.tensor([[False, True, True, False],
                        [True, True, False, True],
                        [True, True, True, True]])
    assert accepted_prefix(acc).tolist() == [0, 2, 4]
    assert accepted_prefix(min_block(acc, 0)).tolist() == [0, 2, 4]
    assert accepted_prefix(min_block(acc, 1)).tolist() == [3, 2, 4]
    assert accepted_prefix(min_block(acc, 3)).tolist() == [3, 4, 4]
    assert min_block(acc, 9).all()
    with pytest.raises(ConfigError):
        min_block(acc, -1)


def test_best_path_longest_then_likeliest():
    tree = build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [1, 0, 0]])
    # nodes: 0 root, 1 (0,), 2 (1,), 3 (0,0), 4 (0,1), 5 (1,0), 6 (1,0,0)
    ok = torch.tensor([True, True, True, False, True, True, False])
    logp = torch.tensor([0.0, -0.1, -2.0, -0.1, -0.3, -0.1, -0.1])
    # depth-2 paths accepted: [0,1,4] (logp -0.4) and [0,2,5] (-2.1) -> the likelier
    assert best_path(ok, tree.retrieve, logp) == [0, 1, 4]
    ok[6] = True
    assert best_path(ok, tree.retrieve, logp) == [0, 2, 5, 6]  # longest wins
    assert best_path(torch.tensor([True, False, False, True, True, True, True]), tree.retrieve) == [0]
    # a node whose parent is rejected does not count
    assert best_path(torch.tensor([True, False, True, True, True, False, True]), tree.retrieve) == [0, 2]


# ------------------------------------------------------------------ rule parsing and whole-tree walk

def test_parse_acceptance_and_labels():
    assert parse_acceptance("exact").exact and parse_acceptance("exact").label == "exact"
    assert parse_acceptance("typical").label == "typical(0.09,0.3)"
    assert parse_acceptance("typical=0.05/0.2").label == "typical(0.05,0.2)"
    assert parse_acceptance("topk=3+min=1") == AcceptanceConfig("topk", k_top=3, min_block=1)
    assert parse_acceptance("topk").k_top == 2
    assert parse_acceptance("dist=0.5").eps == 0.5 and parse_acceptance("min=2").label == "exact+min2"
    assert not parse_acceptance("min=2").exact
    for bad, msg in [("fast", "cannot read"), ("topk=x", "cannot read"), ("dist", "cannot read"),
                     ("typical=1.5", "in \\(0, 1\\)"), ("topk=0", "k_top >= 1"), ("min=-1", ">= 0")]:
        with pytest.raises(ConfigError, match=msg):
            parse_acceptance(bad)
    with pytest.raises(ConfigError, match="eps >= 0"):
        AcceptanceConfig("distance")


def exact_walk(tree, tokens, logits):
    """The lossless greedy walk (acceptance.accept_tree) for comparison."""
    from speculant.acceptance import accept_tree
    from speculant.trees.draft import Draft
    return accept_tree(Draft(tree, tokens), logits, SamplingConfig())


@pytest.mark.parametrize("spec", ["3x2x1", "[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]", "4"])
def test_tree_walk_rules_that_reduce_to_greedy(spec):
    """typical at T=0, topk=1 and dist=0 give the exact greedy walk's path and token; sibling tokens
    are distinct (as the heads' top-k lists are), and the target often agrees with a branch."""
    tree = build_tree(spec)
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(12, 4, generator=g)
    for trial in range(60):
        N = tree.size
        tokens = torch.zeros(N, dtype=torch.long)
        for parent in range(N):
            kids = tree.children[parent][tree.children[parent] >= 0]
            tokens[kids] = torch.randperm(12, generator=g)[: kids.numel()]
        logits = torch.randn(N, 12, generator=g)
        for i in range(1, N):  # make the target agree with some branches
            if torch.rand(1, generator=g) < 0.6:
                logits[tree.parents[i], tokens[i]] += 10
        want = exact_walk(tree, tokens, logits)
        for rule in ("typical", "topk=1", "dist=0"):
            got = accept_tree_approx(tree, tokens, logits, SamplingConfig(), parse_acceptance(rule), embedding=emb)
            assert got == want, (rule, trial)


def test_tree_walk_topk_and_min_block():
    tree = build_tree("2x1")  # nodes: 0 root, 1 (0,), 2 (1,), 3 (0,0), 4 (1,0)
    tokens = torch.tensor([0, 5, 6, 7, 8])
    logits = torch.zeros(5, 10)
    logits[0, 1], logits[0, 6] = 3.0, 2.0  # root: argmax 1, token 6 (node 2) second
    logits[2, 8] = 3.0  # after node 2: node 4's token is the argmax
    logits[4, 9] = 3.0
    assert accept_tree_approx(tree, tokens, logits, SamplingConfig(), parse_acceptance("topk=1")) == ([0], 1)
    assert accept_tree_approx(tree, tokens, logits, SamplingConfig(), parse_acceptance("topk=2")) == ([0, 2, 4], 9)
    # min=1 forces depth 1: the likelier of the two forced nodes (node 2: logp of token 6 > token 5)
    path, tok = accept_tree_approx(tree, tokens, logits, SamplingConfig(), parse_acceptance("min=1"))
    assert path == [0, 2, 4] and tok == 9


# ---- typical acceptance while sampling (Medusa, Cai et al. 2024, section 2.3.1) ---------------

def _tempered(logits, temperature):
    return torch.softmax(logits / temperature, -1)


def test_typical_at_a_temperature_accepts_exactly_above_the_threshold():
    """At T > 0 a drafted token is acceptable iff its tempered probability p(x) exceeds
    min(eps, delta * exp(-H(p))): tokens placed just above and just below the threshold of each
    row, for several temperatures, entropies and (eps, delta)."""
    g = torch.Generator().manual_seed(2)
    for temperature in (0.5, 0.7, 1.0, 1.3):
        for eps, delta in ((0.09, 0.3), (0.3, 0.5), (0.05, 0.1)):
            logits = torch.randn(64, 20, generator=g) * torch.linspace(0.2, 4.0, 64)[:, None]
            p = _tempered(logits, temperature)
            H = -(p * p.log()).sum(-1)
            thr = torch.clamp(delta * torch.exp(-H), max=eps)
            cands = torch.arange(20).expand(64, 20)
            got = typical_accept(p, cands, eps, delta)
            assert torch.equal(got, p > thr[:, None])
            # through the sampling configuration the loop uses: the same verdicts
            q = logits_to_probs(logits, SamplingConfig(temperature=temperature))
            assert torch.equal(typical_accept(q, cands, eps, delta), got)
            assert got.any() and not got.all()  # both verdicts occur


def test_typical_at_a_temperature_takes_the_longest_acceptable_path_and_a_greedy_first_token():
    """On a tree at T = 1: the longest root path of acceptable nodes wins (ties: the larger target
    log-probability), and the token after it is the target's argmax, never a sample, so a step
    always yields at least that one token (the first token, always accepted)."""
    tree = build_tree("2x1")  # nodes: 0 root, 1 (0,), 2 (1,), 3 (0,0), 4 (1,0)
    tokens = torch.tensor([0, 5, 6, 7, 8])
    logits = torch.full((5, 10), -2.0)
    logits[0, 5], logits[0, 6] = 1.0, 1.2  # both depth-1 tokens likely: acceptable
    logits[1, 7] = -5.0  # node 3 (under node 1) unlikely: not acceptable
    logits[2, 8] = 2.0  # node 4 (under node 2) likely: acceptable -> path 0, 2, 4
    logits[4, 3] = 0.5  # after node 4: argmax 3, but far from certain
    sampling = SamplingConfig(temperature=1.0)
    rule = parse_acceptance("typical")
    for seed in range(30):
        got = accept_tree_approx(tree, tokens, logits, sampling, rule, generator=torch.Generator().manual_seed(seed))
        assert got == ([0, 2, 4], 3)
    # equal lengths: the larger log-probability decides (node 1's token 5 < node 2's token 6)
    logits[1, 7], logits[2, 8] = 2.0, 2.0
    assert accept_tree_approx(tree, tokens, logits, sampling, rule)[0] == [0, 2, 4]
    logits[0, 5], logits[0, 6] = 1.2, 1.0
    assert accept_tree_approx(tree, tokens, logits, sampling, rule)[0] == [0, 1, 3]
    # nothing acceptable: the root alone and the greedy token, every time
    flat = torch.zeros(5, 10)
    flat[:, 5:9] = -10.0  # every drafted token unlikely
    flat[0, 9] = 0.3
    for seed in range(30):
        assert accept_tree_approx(tree, tokens, flat, sampling, rule,
                                  generator=torch.Generator().manual_seed(seed)) == ([0], 9)
    # the other rules sample the token after the path at T > 0
    seen = {accept_tree_approx(tree, tokens, flat, sampling, parse_acceptance("topk=1"),
                               generator=torch.Generator().manual_seed(seed))[1] for seed in range(30)}
    assert len(seen) > 3
