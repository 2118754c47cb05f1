"""Which shipped drafter "auto" decodes with (speculant.tuning.choice): the forecast's arithmetic,
the choice it makes either way, the accuracy file it reads, the drafting time it measures, and
the decoder taking the forecast's method (and staying lossless) when both kinds ship."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculant.tuning.costmodel import PassCost
from speculant.tuning.choice import (CacheSweep, Forecast, chain_accepts, choose_drafter, held_out_accepts,
                                      last_level_cache_bytes, time_drafting, tree_accepts)
from speculant.drafters.dynamic_tree import DynamicTree
from speculant.eagle import EagleDrafter

from test_eagle import eagle_for
from tiny import tiny_model_dir, tiny_qwen2

COST = PassCost((1, 2, 4, 8), (30.0, 31.0, 40.0, 60.0))  # ms by rows: a CPU without AMX, roughly


def test_the_forecast_takes_the_tree_with_most_tokens_per_ms():
    f = Forecast("eagle", accepts=chain_accepts([0.6, 0.35, 0.2]), draft_ms=(2.0, 4.0, 6.0))
    assert f.accepts == ((0.6,), (0.6, 0.95), (0.6, 0.95, pytest.approx(1.15)))
    # chains: 1 node 1.6/(31+2); 2: 1.95/(35.5+4) (3 rows: between 2 and 4); 3: 2.15/(40+6); none: 1/30
    rate, shape = f.best(COST)
    assert shape == (2, 2) and rate == pytest.approx(1.95 / 39.5)
    slow = Forecast("eagle", f.accepts, draft_ms=(40.0, 80.0, 120.0))
    assert slow.best(COST) == (pytest.approx(1 / 30), (0, 0))  # drafting dearer than it returns: plain decoding
    assert Forecast("x", chain_accepts([0.9, 0.9]), (1.0,)).best(COST)[1] == (1, 1)  # depths with both numbers only
    wide = Forecast("x", ((0.5, 0.9, 1.0, 1.05),), (2.0,))  # one depth, 1-4 nodes: 3 rows of 4 pay best here
    assert wide.best(COST) == (pytest.approx(1.9 / 37.5), (1, 2))


def test_the_choice_goes_to_whichever_forecast_is_faster():
    hydra = Forecast("hydra", chain_accepts([0.48, 0.24]), draft_ms=(2.0, 4.0))
    eagle_cheap = Forecast("eagle", chain_accepts([0.57, 0.32, 0.20, 0.14]), draft_ms=(3.0, 6.0, 9.0, 12.0))
    eagle_good = Forecast("eagle", chain_accepts([0.9, 0.8, 0.7, 0.6]), draft_ms=(1.0, 2.0, 3.0, 4.0))
    eagle_dear = Forecast("eagle", eagle_cheap.accepts, draft_ms=(15.0, 30.0, 45.0, 60.0))
    chosen, why = choose_drafter([hydra, eagle_good], COST)
    assert chosen is eagle_good and "tokens/s for it" in why and "for hydra on this CPU" in why
    chosen, why = choose_drafter([hydra, eagle_dear], COST)
    assert chosen is hydra and "for eagle on this CPU" in why
    same = Forecast("eagle", hydra.accepts, hydra.draft_ms)
    assert choose_drafter([hydra, same], COST)[0] is hydra  # a tie keeps the first
    # hydra's best 1.48 / (31 + 2) tokens/ms, eagle_cheap's 1.57 / (31 + 3), 3% more: the faster wins,
    # whichever comes first
    assert choose_drafter([hydra, eagle_cheap], COST)[0] is eagle_cheap
    assert choose_drafter([eagle_cheap, hydra], COST)[0] is eagle_cheap
    with pytest.raises(ValueError):
        choose_drafter([], COST)


def test_held_out_accepts_reads_the_shipped_file_and_nothing_else(tmp_path):
    assert held_out_accepts(tmp_path) == {}
    (tmp_path / "accuracy.json").write_text(json.dumps({"drafters": [
        {"kind": "hydra", "path": "sequential", "greedy": [0.5, 0.25]},
        {"kind": "eagle", "path": "eagle", "greedy": [0.6, 0.3], "tree": [[0.6, 0.7], [0.6, 0.9]]}]}))
    assert held_out_accepts(tmp_path) == {"hydra": ((0.5,), (0.5, 0.75)), "eagle": ((0.6, 0.7), (0.6, 0.9))}
    (tmp_path / "accuracy.json").write_text("{not json")
    assert held_out_accepts(tmp_path) == {}
    (tmp_path / "accuracy.json").write_text(json.dumps({"drafters": {"some/path": {"greedy": [0.5]}}}))
    assert held_out_accepts(tmp_path) == {}  # no kinds: nothing to compare


def test_tree_accepts_agrees_with_the_greedy_chain_and_grows_with_the_tree():
    """The best-scored node is the root's top child, so A(d, 1) is the greedy chain's depth-1
    accuracy (eagle.train.depth_accuracy, measured independently); A never falls with more nodes
    and never exceeds min(d, m). (It may fall with depth at a fixed m: deeper nodes can displace
    a shallow one that was right.)"""
    from speculant.training.eagle_train import answer_positions, depth_accuracy

    from speculant.eagle import EagleCache

    target = tiny_qwen2(seed=0, scale=4.0)
    model = eagle_for(target, depth=3)
    g = torch.Generator().manual_seed(0)

    def states(ids):  # the target's final (normed) hidden states, (len(ids), H)
        return target(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]

    records = []
    with torch.no_grad():
        for r in range(8):
            ids = torch.randint(0, 64, (8 if r < 4 else 36,), generator=g).tolist()
            while len(ids) < 36:  # half the records: text whose every next-but-one token the drafter guesses
                feats = model.extend(EagleCache(), states(ids)[:-1], torch.tensor(ids[1:]))
                ids.append(int(model.draft_topk(feats[-1][None], 1, 64)[0, 0]))
            records.append({"ids": ids, "prompt_len": 8})
        hidden = torch.cat([states(r["ids"]) for r in records])
    starts = torch.arange(8) * 36
    positions = answer_positions(records, 30)
    table = tree_accepts(EagleDrafter(model, DynamicTree(nodes=6), 64), records, hidden, starts, positions)
    chain = depth_accuracy(model, records, hidden, starts, 3, per_record=30)[1]
    assert len(table) == 3 and all(len(row) == 6 for row in table)
    assert table[0][0] == pytest.approx(chain[0]) and table[2][0] == pytest.approx(chain[0])
    for d in range(3):
        for m in range(6):
            assert table[d][m] <= min(d + 1, m + 1) + 1e-9
            assert m == 0 or table[d][m] >= table[d][m - 1] - 1e-9
    assert table[0][0] >= 0.5  # the drafter's own text: its first guess is right at every position there


def test_time_drafting_measures_every_depth_and_leaves_the_drafter_as_it_was():
    target = tiny_qwen2(seed=0, scale=4.0)
    drafter = EagleDrafter(eagle_for(target, depth=3), DynamicTree(nodes=8), 64)
    prompt = torch.arange(10, 30)
    hidden = torch.randn(prompt.shape[0] - 1, target.config.hidden_size)
    swept = []
    ms = time_drafting(drafter, prompt, hidden, repeats=2, sweep=lambda: swept.append(1))
    assert len(ms) == 3 and all(t > 0 for t in ms) and drafter.depth == 3
    assert len(swept) == 3 * 2  # every try starts from cold caches, as a decoding step does


def test_the_cache_sweep_reads_twice_the_largest_cache():
    llc = last_level_cache_bytes()
    assert llc >= 1 << 20  # every x86 CPU these run on has a last-level cache of MBs (or the 64 MiB default)
    assert CacheSweep().buffer.numel() * 4 == min(2 * llc, 512 << 20)  # capped: a huge cache costs no more
    sweep = CacheSweep(1 << 20)
    assert sweep.buffer.numel() == (1 << 20) // 4
    sweep()


def test_the_largest_cache_is_read_from_sysfs_and_defaults_where_it_cannot_be(tmp_path, monkeypatch):
    import speculant.tuning.choice as choice

    for i, size in enumerate(("48K", "1024K", "32768K")):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    (tmp_path / "index3").mkdir()
    (tmp_path / "index3" / "size").write_text("garbled\n")
    real = choice.Path
    monkeypatch.setattr(choice, "Path", lambda p: tmp_path if "cache" in str(p) else real(p))
    assert last_level_cache_bytes() == 32 << 20
    monkeypatch.setattr(choice, "Path", lambda p: tmp_path / "missing")
    assert last_level_cache_bytes(default=5) == 5


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """A tiny target with sequential heads and an EAGLE drafter "shipped" for it."""
    from transformers import AutoModelForCausalLM

    from speculant.eagle.checkpoint import save_eagle
    from speculant.heads import HeadsConfig, SequentialHeads, save_heads

    root = tmp_path_factory.mktemp("shipped")
    target = tiny_model_dir(root / "target")
    hf = AutoModelForCausalLM.from_pretrained(target)
    H, V = hf.config.hidden_size, hf.config.vocab_size
    heads = SequentialHeads(HeadsConfig(2, 1, H, V, kind="sequential"), hf.get_output_embeddings(),
                            hf.get_input_embeddings())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    save_heads(heads.eval(), root / "sequential")
    save_eagle(eagle_for(hf, depth=3), root / "eagle")
    return {"target": str(target), "sequential": root / "sequential", "eagle": root / "eagle"}


def _ship(monkeypatch, shipped, accuracy: dict | None):
    """Make speculant find ``shipped``'s heads and drafter for its target, with ``accuracy`` as the
    drafter's accuracy.json (None: no file)."""
    import speculant.heads
    import speculant.store.loading

    f = shipped["eagle"] / "accuracy.json"
    f.unlink(missing_ok=True)
    if accuracy is not None:
        f.write_text(json.dumps({"drafters": [{"kind": k, "greedy": v} for k, v in accuracy.items()]}))

    def found(name, kind="medusa"):  # resolve() asks by the target's path, the loaded model by its name
        return shipped.get(kind) if name in (shipped["target"], Path(shipped["target"]).name) else None

    monkeypatch.setattr(speculant.heads, "shipped_heads", found)
    monkeypatch.setattr(speculant.store.loading, "shipped_heads", found)


@pytest.mark.parametrize("accuracy, method", [
    ({"hydra": [0.05, 0.01], "eagle": [0.95, 0.9, 0.85]}, "eagle"),
    ({"hydra": [0.95, 0.9], "eagle": [0.05, 0.01, 0.0]}, "hydra"),
    (None, "hydra"),
    ({"eagle": [0.95, 0.9, 0.85]}, "hydra"),  # nothing to compare hydra with: hydra, as without a drafter
])
def test_auto_decodes_with_the_drafter_the_forecast_picks(monkeypatch, shipped, accuracy, method):
    from speculant.api import SpeculativeDecoder

    _ship(monkeypatch, shipped, accuracy)
    flat = PassCost((1, 64), (100.0, 100.0))  # any width costs one pass: drafting pays where it is right
    dec = SpeculativeDecoder(shipped["target"], dtype="float32", tree_budget=flat)
    assert dec.method == method and dec.lookup_branch == 8
    assert dec.why.count(f"{method}+lookup (") == 1
    assert ("cost model forecasts" in dec.why) == (accuracy is not None and len(accuracy) == 2)
    assert type(dec.heads).__name__ == {"eagle": "EagleModel", "hydra": "SequentialHeads"}[method]
    plain = SpeculativeDecoder(shipped["target"], dtype="float32", method="ar")
    prompt = "w1 w2 w3 w1 w2"
    assert dec.generate(prompt, 16).token_ids == plain.generate(prompt, 16).token_ids
    explicit = SpeculativeDecoder(shipped["target"], dtype="float32", method="hydra", tree_budget=flat)
    assert explicit.method == "hydra" and "forecasts" not in explicit.why  # only "auto" is chosen for
