"""Predicted Outputs in the library: a ``prediction`` is searched by prompt lookup (alone, as the
heads' lookup branch, or in place of a draft model), the output stays what plain greedy decoding
gives, and a prediction equal to that output is accepted (fewer target passes); the lookup's own
rules (the prediction's start while the output follows it, its n-grams read forward)."""

from __future__ import annotations

import pytest
import torch

from speculant import ConfigError, SpeculativeDecoder
from speculant.drafters.lookup import LookupDrafter
from speculant.heads import HeadsConfig, MedusaHeads, save_heads
from speculant.tuning.costmodel import PassCost

from tiny import tiny_pair

N = 24
PROMPT = "w1 w2 w3 w4 w5 w6 w7"
FLAT = PassCost((1, 64), (100.0, 100.0))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def plain(dirs):
    dec = SpeculativeDecoder(dirs["target"], method="ar", dtype="float32", pacing=False)
    return dec, dec.generate(PROMPT, N)


def _heads(dirs, dec) -> str:
    path = dirs["root"] / "heads"
    if not path.exists():
        lm = dec.target
        save_heads(MedusaHeads(HeadsConfig(3, 1, lm.model.config.hidden_size, lm.logits_dim),
                               lm.model.get_output_embeddings()), path)
    return str(path)


@pytest.mark.parametrize("method, extra", [
    ("ar", {}), ("lookup", {"gamma": 5, "tree_budget": "fixed"}), ("sd", {"gamma": 3}),
    ("medusa", {"tree_budget": FLAT}),  # a dynamic tree, sized: the prediction is its lookup branch
    ("medusa", {"tree_budget": "fixed", "tree": "2x1"}),  # a static tree with the branch added
])
def test_a_prediction_keeps_the_output_and_is_accepted(dirs, plain, method, extra):
    ref, want = plain
    if method == "medusa":
        extra = {**extra, "heads": _heads(dirs, ref)}
    dec = SpeculativeDecoder(dirs["target"], dirs["draft"] if method == "sd" else None, method=method,
                             dtype="float32", pacing=False, **extra)
    alone = dec.generate(PROMPT, N)
    exact = dec.generate(PROMPT, N, prediction=want.token_ids)
    text = dec.generate(PROMPT, N, prediction=want.text)  # its text skips the special tokens the output has
    wrong = dec.generate(PROMPT, N, prediction="w9 w9 w9 w1 w2 w3 w33 w34")
    for got in (alone, exact, text, wrong):
        assert got.token_ids == want.token_ids and got.text == want.text, method
    assert alone.stats.prediction_accepted == alone.stats.prediction_rejected == 0
    assert exact.stats.prediction_accepted > N // 2, exact.stats.to_dict()
    assert exact.stats.target_calls < alone.stats.target_calls, method
    assert 0 < text.stats.prediction_accepted <= exact.stats.prediction_accepted
    assert wrong.stats.prediction_accepted < exact.stats.prediction_accepted
    off = dec.generate(PROMPT, N, prediction=want.text, max_draft_depth=0)  # plain decoding: nothing drafted
    assert off.stats.target_calls == len(want.token_ids) and off.stats.prediction_accepted == 0


def test_a_bad_prediction_is_refused(plain):
    dec, _ = plain
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        dec.generate(PROMPT, 4, prediction=[1, 2, 10_000])
    with pytest.raises(ConfigError, match="list of token ids"):
        dec.generate(PROMPT, 4, prediction=3.5)


def test_end_tokens_end_the_generation(plain):
    dec, want = plain
    cut = dec.generate(PROMPT, N, end_tokens=[want.token_ids[3]])
    first = want.token_ids.index(want.token_ids[3])
    assert cut.token_ids == want.token_ids[:first + 1] and cut.finish_reason == "eos"


def _t(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def test_lookup_follows_the_prediction_from_its_start():
    lookup = LookupDrafter(gamma=3, prediction=_t(7, 8, 9, 10, 11))
    lookup.begin(_t(1, 2, 3))
    cont, predicted = lookup.match(_t(1, 2, 3))  # nothing generated yet: the prediction's start
    assert cont.tolist() == [7, 8, 9] and predicted
    cont, predicted = lookup.match(_t(1, 2, 3, 7, 8))
    assert cont.tolist() == [9, 10, 11] and predicted
    draft = lookup.propose(_t(1, 2, 3, 7, 8))
    assert draft.predicted.tolist() == [False, True, True, True]


def test_lookup_reads_the_prediction_forward_then_falls_back_to_the_context():
    # the prediction repeats "5 6": the match at or after the last chain's start wins
    lookup = LookupDrafter(gamma=2, max_ngram=2, prediction=_t(5, 6, 1, 5, 6, 2))
    lookup.begin(_t(0))
    lookup._cursor = 3
    cont, predicted = lookup.match(_t(0, 9, 5, 6))  # diverged from the prediction's start
    assert cont.tolist() == [2] and predicted
    # no match in the prediction: the context's own n-grams, unmarked
    cont, predicted = lookup.match(_t(0, 4, 8, 4))
    assert cont.tolist() == [8, 4] and not predicted
    assert lookup.propose(_t(0, 4, 8, 4)).predicted is None
