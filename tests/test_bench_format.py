"""The bench's constrained rows (``@format=``): a row whose output must match a response format,
compared with the plain row of the same format, so a grammar's cost on speculation is measured
side by side with the same method unconstrained."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from speculant.bench.harness import BenchConfig, load_questions, run_bench
from speculant.bench.methods import parse_method, plain_of, response_format_of
from speculant.errors import ConfigError


def test_format_option_parses_and_names_its_plain_row(tmp_path):
    schema = tmp_path / "order.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}))
    assert parse_method("auto@format=json").options == {"format": "json"}
    assert plain_of("auto@format=json") == "ar@format=json"
    assert plain_of("lookup@quant=gguf@format=json") == "ar@quant=gguf@format=json"
    assert plain_of("lookup@format=json@quant=gguf") == "ar@quant=gguf@format=json"  # one order for the plain row
    assert plain_of("auto") == "ar" and response_format_of("auto") is None
    assert response_format_of("ar@format=json") == {"type": "json_object"}
    rf = response_format_of(f"sd@format={schema}")
    assert rf["type"] == "json_schema" and rf["json_schema"]["schema"]["required"] == ["n"]
    assert rf["json_schema"]["strict"] is True and rf["json_schema"]["name"] == "order"


@pytest.mark.parametrize("spec, msg", [
    ("auto@format=yaml", "format='yaml'"),
    ("auto@format=/no/such/schema.json", "an existing file"),
    ("llama-server@format=json", "applies to speculant's methods only"),
    ("auto@format=", "has no value"),
])
def test_bad_format_option_names_the_bad_part(spec, msg):
    with pytest.raises(ConfigError, match=msg):
        BenchConfig("t", "d", methods=("ar", spec))


def test_the_json_tasks_are_questions_of_their_own_category():
    path = resources.files("speculant").joinpath("data/json_tasks.jsonl")
    rows = load_questions(str(path))
    assert len(rows) == 12 and {r["group"] for r in rows} == {"json"}
    assert all("JSON" in r["turns"][0] for r in rows)
    spec_bench = {r["turns"][0] for r in load_questions()}
    assert not spec_bench & {r["turns"][0] for r in rows}


@pytest.mark.real
def test_constrained_rows_run_beside_free_ones(tmp_path):
    """On a real model and tokenizer: the constrained rows write JSON and the speculative ones give
    exactly their plain row's output, free and constrained alike."""
    path = resources.files("speculant").joinpath("data/json_tasks.jsonl")
    methods = ("ar", "lookup", "ar@format=json", "lookup@format=json")
    res = run_bench(BenchConfig("smollm2-135m-instruct", None, methods=methods, per_category=2, max_new_tokens=24,
                                categories=("json",), questions=str(path), dtype="float32",
                                json_out=str(tmp_path / "bench.json")))
    s = res["summary"]
    assert s["lookup@format=json"]["plain"] == "ar@format=json" and s["lookup@format=json"]["identical_to_plain"] == 2
    assert s["lookup"]["plain"] == "ar" and s["lookup"]["identical_to_plain"] == 2
    for row in res["runs"]:
        if row["method"].endswith("@format=json"):
            assert row["text"].lstrip().startswith("{"), row["text"]
