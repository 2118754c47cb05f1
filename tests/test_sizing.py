"""Hardware-aware tree sizing: the measured pass-cost curve (costmodel.py) and the per-step choice
of a dynamic tree's size against it (drafters/sizing.py). The choice may only move speed: greedy
output stays identical to plain decoding whatever the curve says."""

from __future__ import annotations

import itertools
import json
import math
import pathlib

import pytest
import torch

from speculant.backends.hf import HFBackend
from speculant.tuning.costmodel import PassCost, measure_pass_cost, pass_cost
from speculant.drafters.lookup import LookupDrafter
from speculant.drafters.medusa import DynamicTree, MedusaDrafter
from speculant.tuning.sizing import TreeSizer
from speculant.errors import ConfigError
from speculant.heads import HeadsConfig, SequentialHeads
from speculant.trees.buffers import build_tree

from helpers import decode_to_end
from test_medusa import H, V, plain, prompts, seq_heads_random, target  # noqa: F401 (fixtures)
from tiny import tiny_llama

FLAT = PassCost((1, 64), (100.0, 100.0))  # every width costs one row's pass (the AMX limit case)
STEEP = PassCost((1, 2, 64), (100.0, 1000.0, 63000.0))  # a second row costs 9 rows' worth of time
AVX512 = PassCost((1, 8, 16, 29, 32), (156.0, 167.0, 232.0, 320.0, 372.0))  # measured: AMD EPYC, oneDNN


# ---- the cost curve ----------------------------------------------------------------------------

def test_pass_cost_interpolates_and_extrapolates():
    c = PassCost((1, 8, 16), (100.0, 110.0, 150.0))
    assert c(1) == 100.0 and c(8) == 110.0 and c(16) == 150.0
    assert c(4) == pytest.approx(100.0 + 10.0 * 3 / 7)
    assert c(12) == pytest.approx(130.0)
    assert c(24) == pytest.approx(190.0)  # past the widest: the last segment's slope
    assert PassCost((1,), (7.0,))(30) == 7.0
    assert c.relative() == {1: 1.0, 8: 1.1, 16: 1.5}
    with pytest.raises(ValueError, match="at least one row"):
        c(0)


def test_pass_cost_grows_with_context():
    c = PassCost((1, 16), (100.0, 150.0), context=64, slope=(0.0, 0.1))
    assert c(16) == 150.0 and c(16, 64) == 150.0 and c(16, 564) == pytest.approx(200.0)
    assert c(1, 5000) == 100.0
    assert c(8, 564) == pytest.approx(100.0 + 50.0 * 7 / 15 + 0.1 * 7 / 15 * 500)
    assert c(16, 0) == pytest.approx(150.0 - 6.4)
    assert PassCost((1, 16), (100.0, 150.0), 64, (0.0, 10.0))(16, 0) == 75.0  # never below half
    with pytest.raises(ConfigError, match="slopes must be >= 0 and non-decreasing"):
        PassCost((1, 16), (100.0, 150.0), 64, (0.2, 0.1))
    with pytest.raises(ConfigError, match="as many times"):
        PassCost((1, 16), (100.0, 150.0), 64, (0.1,))
    assert PassCost.monotone((1, 4, 8), (1.0, 2.0, 3.0), 10, (0.1, -0.2, 0.05)).slope == (0.1, 0.1, 0.1)


def test_pass_cost_rejects_bad_curves_and_smooths_noise():
    with pytest.raises(ConfigError, match="start at 1 and increase"):
        PassCost((2, 4), (1.0, 2.0))
    with pytest.raises(ConfigError, match="start at 1 and increase"):
        PassCost((1, 4, 4), (1.0, 2.0, 3.0))
    with pytest.raises(ConfigError, match="as many times .* as widths"):
        PassCost((1, 4), (1.0,))
    with pytest.raises(ConfigError, match="positive and non-decreasing"):
        PassCost((1, 4), (2.0, 1.0))
    assert PassCost.monotone((1, 2, 4, 8), (10.0, 12.0, 11.0, 15.0)).ms == (10.0, 12.0, 12.0, 15.0)


def test_measure_pass_cost_on_a_tiny_model_leaves_the_cache_empty():
    backend = HFBackend(tiny_llama(seed=0, vocab=V, hidden=H))
    cost = measure_pass_cost(backend, widths=(4, 1, 2), context=8, long_context=40, long_widths=(4,), reps=1)
    assert cost.rows == (1, 2, 4) and all(m > 0 for m in cost.ms) and cost.context == 8
    assert list(cost.ms) == sorted(cost.ms)
    assert len(cost.slope) == 3 and list(cost.slope) == sorted(cost.slope) and min(cost.slope) >= 0
    assert backend.cache_length == 0
    assert measure_pass_cost(backend, widths=(1, 2), context=8, long_context=0, reps=1).slope == ()
    with pytest.raises(ConfigError, match="must include 1"):
        measure_pass_cost(backend, widths=(2, 4))
    with pytest.raises(ConfigError, match="long_context 0 or > context"):
        measure_pass_cost(backend, context=64, long_context=32)


def test_pass_cost_is_cached_per_key(tmp_path, monkeypatch):
    import speculant.tuning.costmodel as cm

    # cache every measurement even if other jobs hold the cores (the busy case: test_costmodel_busy.py)
    monkeypatch.setattr(cm, "BUSY_WAIT", float("inf"))
    backend = HFBackend(tiny_llama(seed=0, vocab=V, hidden=H))
    path = tmp_path / "sub" / "pass_cost.json"
    first = pass_cost(backend, "machine A", path=path, quiet=True, widths=(1, 2), context=4, long_context=12, reps=1)
    assert json.loads(path.read_text())["curves"]["machine A"]["rows"] == [1, 2]

    def no_measuring(*a, **k):
        raise AssertionError("measured again")

    measure = cm.measure_pass_cost
    monkeypatch.setattr(cm, "measure_pass_cost", no_measuring)
    again = pass_cost(backend, "machine A", path=path, quiet=True)
    assert again.rows == first.rows and again.ms == pytest.approx(first.ms, abs=1e-3)
    assert again.context == 4 and again.slope == pytest.approx(first.slope, abs=1e-4)
    monkeypatch.setattr(cm, "measure_pass_cost", measure)
    pass_cost(backend, "machine B", path=path, quiet=True, widths=(1, 3), context=4, long_context=0, reps=1)
    assert set(json.loads(path.read_text())["curves"]) == {"machine A", "machine B"}
    path.write_text("{not json")  # a damaged file is measured over, then rewritten whole
    pass_cost(backend, "machine A", path=path, quiet=True, widths=(1, 2), context=4, long_context=0, reps=1)
    assert set(json.loads(path.read_text())["curves"]) == {"machine A"}


def test_machine_key_changes_with_the_kernels_sources(tmp_path, monkeypatch):
    """A curve measured with other kernel sources is not reused: the key holds their hash, which
    follows every byte of every .cpp and .h of the kernels (a copy of them, edited here)."""
    import shutil

    import speculant.kernels as k
    from speculant.tuning.costmodel import machine_key

    machine_key("m", torch.bfloat16, "native")  # the kernels loaded (or built) from the real sources, once
    copy = tmp_path / "kernels"
    shutil.copytree(pathlib.Path(k.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))

    def digest_of(directory):
        monkeypatch.setattr(k, "__file__", str(directory / "__init__.py"))
        k.sources_digest.cache_clear()
        try:
            return k.sources_digest(), machine_key("m", torch.bfloat16, "native")
        finally:
            monkeypatch.undo()
            k.sources_digest.cache_clear()

    before, key = digest_of(copy)
    assert before == k.sources_digest() and before in key and len(before) == 12
    header = copy / "int4_avx2_chunk.h"
    header.write_text(header.read_text() + "\n")
    after, changed = digest_of(copy)
    assert after != before and changed != key and changed.replace(after, before) == key
    (copy / "notes.txt").write_text("not a source")  # other files do not count
    assert digest_of(copy)[0] == after


# ---- the per-step choice -------------------------------------------------------------------------

def brute_force(sizer, scores, walk, n_chain):
    """Every (m, c) evaluated from the definition E / T, by enumeration."""
    kappa, r = sizer.kappa, sizer.chain_rates(n_chain)
    best, rate = None, -1.0
    for m in range(len(scores) + 1):
        k = sum(1 for i in walk if i < m)
        for c in range(n_chain - k + 1):
            rows = 1 + m + c
            if sizer.max_rows is not None and rows > sizer.max_rows:
                continue
            e = 1 + kappa * sum(math.exp(s) for s in scores[:m]) + sum(r[k:k + c])
            x = e / (sizer.cost(rows) + sizer.overhead_ms)
            if x > rate + 1e-12:
                best, rate = (m, c), x
    return best


@pytest.mark.parametrize("cost", [FLAT, STEEP, AVX512], ids=["flat", "steep", "avx512"])
def test_choice_maximizes_expected_tokens_per_millisecond(cost):
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = int(torch.randint(0, 25, (1,), generator=g))
        scores = sorted((torch.rand(n, generator=g) * -6).tolist(), reverse=True)
        walk = sorted(torch.randperm(max(n, 1), generator=g)[: int(torch.randint(0, 4, (1,), generator=g))].tolist())
        walk = [i for i in walk if i < n]
        n_chain = int(torch.randint(len(walk), len(walk) + 9, (1,), generator=g))
        sizer = TreeSizer(cost, max_rows=[None, 32, 8][trial % 3])
        sizer.overhead_ms = float(trial)
        assert sizer.choose(scores, walk, n_chain) == brute_force(sizer, scores, walk, n_chain)


def test_flat_cost_takes_everything_and_steep_cost_takes_the_root():
    scores = [math.log(p) for p in (0.9, 0.5, 0.3, 0.1, 0.05)]
    assert TreeSizer(FLAT).choose(scores, [], 4) == (5, 4)
    m, c = TreeSizer(FLAT, max_rows=4).choose(scores, [], 4)
    assert 1 + m + c == 4
    assert TreeSizer(STEEP).choose(scores, [], 4) == (0, 0)
    # the measured AVX-512 curve: confident nodes are worth their rows, a long unproven chain less so
    m, c = TreeSizer(AVX512).choose(scores, [], 8)
    assert 1 <= m <= 5 and 1 + m + c <= 16


def test_a_longer_context_never_widens_the_tree():
    cost = PassCost((1, 8, 16, 32), (156.0, 167.0, 232.0, 372.0), context=64, slope=(0.0, 0.01, 0.04, 0.1))
    g = torch.Generator().manual_seed(1)
    narrower = 0
    for _ in range(30):
        scores = sorted((torch.rand(24, generator=g) * -4).tolist(), reverse=True)
        rows = []
        for context in (64, 1000, 4000):
            m, c = TreeSizer(cost).choose(scores, [], 6, context=context)
            rows.append(1 + m + c)
        assert rows == sorted(rows, reverse=True)
        narrower += rows[-1] < rows[0]
    assert narrower > 0


def test_estimates_follow_what_is_accepted():
    sizer = TreeSizer(AVX512)
    assert sizer.kappa == 1.0 and sizer.chain_rates(2) == [0.5, 0.25]
    tokens = torch.tensor([0, 11, 12, 21, 22, 23])  # root, two heads' nodes, a 3-token chain
    for _ in range(30):  # the heads promise 1.8 tokens, nothing is ever accepted
        sizer.last_choice = (2, 3)
        sizer.drafted(tokens, [21, 22, 23], [math.log(0.9)] * 2)
        sizer.observe([0])
    assert sizer.kappa < 0.3 and sizer.chain_rates(3)[0] < 0.1
    for _ in range(150):  # now the chain's first two tokens are accepted every time
        sizer.last_choice = (2, 3)
        sizer.drafted(tokens, [21, 22, 23], [math.log(0.9)] * 2)
        sizer.observe([0, 3, 4])
    r = sizer.chain_rates(3)
    assert r[0] > 0.9 and r[1] > 0.9 and r[2] < 0.2
    sizer.drafting_took(10.0)
    sizer.drafting_took(20.0)
    assert sizer.overhead_ms == pytest.approx(12.0)


def test_a_depth_is_drafted_only_while_its_nodes_can_pay_for_it():
    sizer = TreeSizer(FLAT)  # a token is worth at most one single-row pass: 100 ms
    confident = [math.log(0.5)] * 4  # the next depth returns at most 4 x 0.5 = 2 tokens: 200 ms
    assert sizer.worth_deeper(confident, depth_ms=150.0)
    assert not sizer.worth_deeper(confident, depth_ms=250.0)
    assert not sizer.worth_deeper([math.log(0.001)] * 4, depth_ms=1.0)
    sizer.heads_pred, sizer.heads_seen = 100.0, 30.0  # heads overconfident: kappa ~ 0.31
    assert not sizer.worth_deeper(confident, depth_ms=150.0)
    sizer.share(rows=7, tokens=3.0)  # the pass is wider: a token is worth cost(8) rows
    assert sizer.worth_deeper(confident, depth_ms=60.0)
    # each node the depth adds needs a row: where rows are dear it pays only as far as p x value
    # beats the row (AVX-512 without AMX: 4-6 ms a row against 32 ms for one)
    dear = TreeSizer(PassCost((1, 2, 4), (100.0, 100.0, 200.0)))  # from 2 rows on, 50 ms a row
    assert dear.worth_deeper(confident, depth_ms=150.0)  # the tree's second row comes free
    assert not dear.worth_deeper(confident, depth_ms=1.0, rows=2)  # 4 x max(0, 0.5 x 100 - 50) = 0
    assert dear.worth_deeper([math.log(0.9)] * 2, depth_ms=70.0, rows=2)  # 2 x (90 - 50) = 80
    assert not dear.worth_deeper([math.log(0.9)] * 2, depth_ms=90.0, rows=2)


def test_the_dynamic_tree_stops_deepening_when_a_depth_costs_more_than_it_can_return(seq_heads_random):
    root, hidden = torch.tensor([3]), torch.randn(H)
    drafter = MedusaDrafter(seq_heads_random, build_tree("2"), V, dynamic=DynamicTree(nodes=40, depth=3),
                            sizer=TreeSizer(FLAT))
    full, _ = drafter.grow(hidden, root)
    assert max(len(p) for p in full) == 3 and drafter.depth_ms > 0  # the first step measures a depth
    drafter.depth_ms = 1e9  # a depth now costs more than any node could return
    shallow, _ = drafter.grow(hidden, root)
    assert max(len(p) for p in shallow) == 1 and len(shallow) == drafter.dynamic.top_k
    no_sizer = MedusaDrafter(seq_heads_random, build_tree("2"), V, dynamic=DynamicTree(nodes=40, depth=3))
    no_sizer.depth_ms = 1e9  # without a cost model every step drafts every depth
    assert max(len(p) for p in no_sizer.grow(hidden, root)[0]) == 3


# ---- lossless whatever the curve -----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("cost", [FLAT, STEEP, AVX512], ids=["flat", "steep", "avx512"])
@pytest.mark.parametrize("lookup", [0, 3])
def test_sized_trees_are_lossless(target, plain, seq_heads_random, cost, lookup):
    sizer = TreeSizer(cost, max_rows=12)  # shared across prompts, as a decoder shares it
    sizes = set()
    for prompt, ref in zip(prompts(), plain):
        drafter = MedusaDrafter(seq_heads_random, build_tree("2"), V, LookupDrafter(lookup) if lookup else None,
                                dynamic=DynamicTree(nodes=10, depth=3), sizer=sizer)
        passes = drafter.propose_passes  # what the loop calls (the heads' calls as jobs)

        def logged(context, passes=passes):
            d = yield from passes(context)
            sizes.add(d.tree.size)
            return d

        drafter.propose_passes = logged
        assert decode_to_end(target, drafter, prompt).generated == ref
    assert max(sizes) <= 12
    if cost is STEEP:
        assert sizes == {1}
    if cost is FLAT:  # every row adds expected tokens at no cost: always the widest tree allowed
        assert max(sizes) == min(12, 1 + 10 + lookup)


def test_sizer_needs_a_dynamic_tree(seq_heads_random):
    with pytest.raises(ConfigError, match="needs a dynamic tree"):
        MedusaDrafter(seq_heads_random, build_tree("2"), V, sizer=TreeSizer(FLAT))


def test_decoder_tree_budget(tmp_path, monkeypatch):
    """tree_budget: 'auto' (default) measures the curve once (cached under $SPECULANT_CACHE) and lets
    hydra's tree grow to DEFAULT_MAX_ROWS rows; 'fixed' keeps the fixed 16 rows; a PassCost is used
    as given; anything else is a clear error. Greedy output equals plain decoding in every case."""
    import speculant
    from speculant import SpeculativeDecoder
    from speculant.api import DEFAULT_MAX_ROWS
    from tiny import tiny_model_dir

    import speculant.tuning.costmodel as cm

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cm, "BUSY_WAIT", float("inf"))  # cached even while other jobs (another test process) run
    lm = speculant.load(tiny_model_dir(tmp_path / "m"), "float32")
    heads = SequentialHeads(HeadsConfig(3, 1, lm.model.config.hidden_size, lm.logits_dim, kind="sequential"),
                            lm.model.get_output_embeddings(), lm.model.get_input_embeddings())
    auto = SpeculativeDecoder(lm, method="hydra", heads=heads, lookup_branch=8, dtype="float32")
    assert auto.sizer is not None and auto.dynamic.nodes == DEFAULT_MAX_ROWS - 1 - 8
    assert (tmp_path / "cache" / "pass_cost.json").is_file()
    fixed = SpeculativeDecoder(lm, method="hydra", heads=heads, lookup_branch=8, dtype="float32", tree_budget="fixed")
    assert fixed.sizer is None and fixed.dynamic.nodes == 7
    given = SpeculativeDecoder(lm, method="hydra", heads=heads, dtype="float32", tree_budget=STEEP)
    assert given.sizer.cost is STEEP
    plain = SpeculativeDecoder(lm, method="ar", dtype="float32")
    prompt = "w1 w2 w3 w1 w2 w3 w1"
    ref = plain.generate(prompt, 24).token_ids
    for dec in (auto, fixed, given):
        assert dec.generate(prompt, 24).token_ids == ref
    r = given.generate(prompt, 24)
    assert r.stats.target_calls == len(r.token_ids)  # a second row never pays: the root alone
    with pytest.raises(ConfigError, match="unknown tree budget 'big'"):
        SpeculativeDecoder(lm, method="hydra", heads=heads, dtype="float32", tree_budget="big")
    assert SpeculativeDecoder(lm, method="ar", dtype="float32").sizer is None
