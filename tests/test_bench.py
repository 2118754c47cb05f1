"""The bench harness's pure parts: method names with acceptance rules, and the quality scores
(BLEU on translation, exact match of the final number on math_reasoning)."""

from __future__ import annotations

import pytest

from speculant.bench.harness import BenchConfig, final_number, quality_scores, split_method, tree_budget_of
from speculant.errors import ConfigError


def test_split_method():
    assert split_method("sd") == ("sd", "exact")
    assert split_method("bpd:topk=2+min=1") == ("bpd", "topk=2+min=1")
    assert split_method("hydra+lookup@fixed") == ("hydra+lookup", "exact")
    assert split_method("medusa:typical@auto") == ("medusa", "typical")
    assert tree_budget_of("hydra+lookup@fixed", "auto") == "fixed"
    assert tree_budget_of("hydra+lookup", "fixed") == "fixed" and tree_budget_of("hydra", "auto") == "auto"


def test_bench_config_validates_methods():
    BenchConfig("t", "d", methods=("ar", "medusa", "medusa:typical", "bpd:topk=2", "hydra+lookup", "hydra+lookup@fixed"))
    with pytest.raises(ConfigError, match="unknown --tree-budget 'wide'"):
        BenchConfig("t", "d", methods=("ar",), tree_budget="wide")
    for methods, msg in [(("ar", "turbo"), "unknown bench method"), (("ar", "bpd:fast"), "cannot read"),
                         (("ar", "hf-assisted:typical"), "own methods"), (("sd",), "baseline"),
                         (("ar", "sd", "sd"), "twice"), (("ar", "hydra@big"), "@auto or @fixed"),
                         (("ar", "sd@fixed"), "medusa and hydra only")]:
        with pytest.raises(ConfigError, match=msg):
            BenchConfig("t", "d", methods=methods)


@pytest.mark.parametrize("text,want", [
    ("He pays 400*.5=$<<400*.5=200>>200 more\n#### 1,000", "1000"),
    ("So the answer is 42.", "42"),
    ("It costs $18.00 in total.", "18.00"),
    ("The result is 7.0", "7"),
    ("-3 degrees", "-3"),
    ("no digits here", None),
])
def test_final_number(text, want):
    assert final_number(text) == want


def test_quality_scores():
    rows = [
        {"category": "translation", "text": "the cat sat on the mat", "reference": "the cat sat on the mat"},
        {"category": "translation", "text": " a dog ran in the park", "reference": "a dog ran in the park"},
        {"category": "math_reasoning", "text": "... so 12 apples", "reference": "6*2=12\n#### 12"},
        {"category": "math_reasoning", "text": "the answer is 13", "reference": "#### 12"},
        {"category": "qa", "text": "whatever"},
    ]
    q = quality_scores(rows)
    assert q["bleu"] == pytest.approx(100.0) and q["math_em"] == 0.5
    worse = quality_scores([dict(rows[0], text="a cat sat on a mat"), rows[1]])
    assert 0 < worse["bleu"] < 100 and worse["math_em"] is None
    assert quality_scores([rows[4]]) == {"bleu": None, "math_em": None}
