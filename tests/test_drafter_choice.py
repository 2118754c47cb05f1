"""Which shipped drafter "auto" decodes with (speculant.drafters.choice): the forecast's arithmetic,
the choice it makes either way, the accuracy file it reads, the drafting time it measures, and
the decoder taking the forecast's method (and staying lossless) when both kinds ship."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculant.costmodel import PassCost
from speculant.drafters.choice import Forecast, choose_drafter, held_out_accuracy, time_drafting
from speculant.drafters.dynamic_tree import DynamicTree
from speculant.eagle import EagleDrafter

from test_eagle import eagle_for
from tiny import tiny_model_dir, tiny_qwen2

COST = PassCost((1, 2, 4, 8), (30.0, 31.0, 40.0, 60.0))  # ms by rows: a CPU without AMX, roughly


def test_the_forecast_takes_the_chain_depth_with_most_tokens_per_ms():
    f = Forecast("eagle", accuracy=(0.6, 0.35, 0.2), draft_ms=(2.0, 4.0, 6.0))
    # D=0: 1/30; D=1: 1.6/(31+2); D=2: 1.95/(35.5+4) (3 rows: between 2 and 4); D=3: 2.15/(40+6)
    rates = [1 / 30, 1.6 / 33, 1.95 / 39.5, 2.15 / 46]
    rate, depth = f.best(COST)
    assert depth == max(range(4), key=rates.__getitem__) == 2 and rate == pytest.approx(rates[2])
    slow = Forecast("eagle", accuracy=(0.6, 0.35, 0.2), draft_ms=(40.0, 80.0, 120.0))
    assert slow.best(COST) == (pytest.approx(1 / 30), 0)  # drafting dearer than it returns: plain decoding
    assert Forecast("x", (0.9, 0.9), (1.0,)).best(COST)[1] == 1  # only depths with both numbers count


def test_the_choice_goes_to_whichever_forecast_is_faster():
    hydra = Forecast("hydra", accuracy=(0.48, 0.24), draft_ms=(2.0, 4.0))
    eagle_cheap = Forecast("eagle", accuracy=(0.57, 0.32, 0.20, 0.14), draft_ms=(3.0, 6.0, 9.0, 12.0))
    eagle_dear = Forecast("eagle", accuracy=(0.57, 0.32, 0.20, 0.14), draft_ms=(15.0, 30.0, 45.0, 60.0))
    chosen, why = choose_drafter([hydra, eagle_cheap], COST)
    assert chosen is eagle_cheap and "tokens/s for it" in why and "for hydra on this CPU" in why
    chosen, why = choose_drafter([hydra, eagle_dear], COST)
    assert chosen is hydra and "for eagle on this CPU" in why
    same = Forecast("eagle", hydra.accuracy, hydra.draft_ms)
    assert choose_drafter([hydra, same], COST)[0] is hydra  # a tie keeps the first
    with pytest.raises(ValueError):
        choose_drafter([], COST)


def test_held_out_accuracy_reads_the_shipped_file_and_nothing_else(tmp_path):
    assert held_out_accuracy(tmp_path) == {}
    (tmp_path / "accuracy.json").write_text(json.dumps({"drafters": [
        {"kind": "hydra", "path": "sequential", "greedy": [0.5, 0.25]},
        {"kind": "eagle", "path": "eagle", "greedy": [0.6, 0.3, 0.2], "top4": [0.8]}]}))
    assert held_out_accuracy(tmp_path) == {"hydra": (0.5, 0.25), "eagle": (0.6, 0.3, 0.2)}
    (tmp_path / "accuracy.json").write_text("{not json")
    assert held_out_accuracy(tmp_path) == {}
    (tmp_path / "accuracy.json").write_text(json.dumps({"drafters": {"some/path": {"greedy": [0.5]}}}))
    assert held_out_accuracy(tmp_path) == {}  # no kinds: nothing to compare


def test_time_drafting_measures_every_depth_and_leaves_the_drafter_as_it_was():
    target = tiny_qwen2(seed=0, scale=4.0)
    drafter = EagleDrafter(eagle_for(target, depth=3), DynamicTree(nodes=8), 64)
    prompt = torch.arange(10, 30)
    hidden = torch.randn(prompt.shape[0] - 1, target.config.hidden_size)
    ms = time_drafting(drafter, prompt, hidden, repeats=2)
    assert len(ms) == 3 and all(t > 0 for t in ms) and drafter.depth == 3


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
    import speculant.loading

    f = shipped["eagle"] / "accuracy.json"
    f.unlink(missing_ok=True)
    if accuracy is not None:
        f.write_text(json.dumps({"drafters": [{"kind": k, "greedy": v} for k, v in accuracy.items()]}))

    def found(name, kind="medusa"):  # resolve() asks by the target's path, the loaded model by its name
        return shipped.get(kind) if name in (shipped["target"], Path(shipped["target"]).name) else None

    monkeypatch.setattr(speculant.heads, "shipped_heads", found)
    monkeypatch.setattr(speculant.loading, "shipped_heads", found)


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
