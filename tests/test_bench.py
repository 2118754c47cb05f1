"""The bench harness: method specs (acceptance rules, per-row @KEY=VALUE options), the quality
scores (BLEU on translation, exact match of the final number on math_reasoning), the summary with
peer rows (same as own plain, vs best peer, decode-only rates), the 80-column tables,
`bench-report` (Markdown, README section, plot), skipped and fake peers on tiny models, and one
end-to-end run with the real peers (``real``; skipped unless both are installed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculant.bench import harness
from speculant.bench.harness import BenchConfig, _row_settings, run_bench
from speculant.bench.methods import PEERS, parse_method, plain_of, split_method, tree_budget_of
from speculant.bench.report import (BEGIN, END, final_number, load_result, markdown_table, newest_result,
                                    print_summary, quality_scores, summarize, update_readme)
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
                         (("ar", "sd@fixed"), "medusa, hydra and eagle only")]:
        with pytest.raises(ConfigError, match=msg):
            BenchConfig("t", "d", methods=methods)


def test_method_spec_options(tmp_path):
    heads = tmp_path / "heads-a"
    heads.mkdir()
    spec = parse_method(f"hydra+lookup@heads={heads}@tree=dynamic:16:3@lookup=12")
    assert (spec.name, spec.base, spec.lookup, spec.rule) == ("hydra+lookup", "hydra", True, "exact")
    assert spec.options == {"heads": str(heads), "tree": "dynamic:16:3", "lookup": "12"}
    assert parse_method("medusa:typical@fixed").options == {"budget": "fixed"}
    assert parse_method("medusa+lookup@budget=auto@tree=dynamic:23:4").options == {"budget": "auto",
                                                                                   "tree": "dynamic:23:4"}
    assert parse_method("sd@gamma=3").int_option("gamma") == 3 and parse_method("sd").int_option("gamma") is None
    assert tree_budget_of("hydra@budget=fixed", "auto") == "fixed"
    # two rows of one method with different heads run side by side
    BenchConfig("t", "d", methods=("ar", f"hydra+lookup@heads={heads}", "hydra+lookup"))
    # a row's options override the bench-wide settings; the other rows keep them
    cfg = BenchConfig("t", "d", methods=("ar",), gamma=5, lookup_branch=8, hydra_heads="/shipped", tree="2x1x1x1")
    assert _row_settings(spec, cfg) == {"tree": "dynamic:16:3", "heads": str(heads), "gamma": 5,
                                        "lookup_branch": 12, "tree_budget": "auto"}
    assert _row_settings(parse_method("hydra"), cfg) == {"tree": None, "heads": "/shipped", "gamma": 5,
                                                         "lookup_branch": 0, "tree_budget": "auto"}
    assert _row_settings(parse_method("hydra+lookup@fixed"), cfg)["lookup_branch"] == 8
    assert _row_settings(parse_method("hydra+lookup@fixed"), cfg)["tree_budget"] == "fixed"
    assert _row_settings(parse_method("mcsd"), cfg)["tree"] == "2x1x1x1"
    # --heads naming an EAGLE drafter goes to the eagle rows only (auto keeps the shipped heads)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text('{"speculant_eagle": {}}')
    ecfg = BenchConfig("t", "d", methods=("ar",), heads=str(drafter))
    assert _row_settings(parse_method("eagle+lookup"), ecfg)["heads"] == str(drafter)
    assert _row_settings(parse_method("auto"), ecfg)["heads"] is None
    assert _row_settings(parse_method("medusa"), BenchConfig("t", "d", methods=("ar",), heads="/m"))["heads"] == "/m"
    assert _row_settings(parse_method("sd@gamma=2"), cfg)["gamma"] == 2
    tree = tmp_path / "tree.json"
    tree.write_text("[[0], [1], [0, 0]]")
    assert _row_settings(parse_method(f"medusa@tree={tree}"), cfg)["tree"] == "[[0], [1], [0, 0]]"


@pytest.mark.parametrize("spec,msg", [
    ("hydra+lookup@size=3", "unknown option 'size'; valid keys for hydra\\+lookup: heads, tree, budget, lookup"),
    ("sd@heads=x", "option 'heads' applies to medusa, hydra, eagle and bpd only; valid keys for sd: gamma"),
    ("ar@gamma=2", "option 'gamma' applies to sd, lookup and bpd only; valid keys for ar: quant"),
    ("ar@quant=q8", "quant='q8': the target's quantization on the native runtime: int4, gguf, int8, none"),
    ("llama-server@quant=gguf", "option 'quant' applies to speculant's methods only; llama-server takes no"),
    ("hydra@lookup=4", "option 'lookup' applies to medusa\\+lookup, hydra\\+lookup and eagle\\+lookup only"),
    ("hydra+lookup@lookup=0", "lookup='0': the prompt-lookup chain's length, an integer >= 1"),
    ("sd@gamma=many", "gamma='many'"),
    ("hydra@budget=wide", "budget='wide': a tree budget is @auto or @fixed"),
    ("hydra@", "an empty option after '@'; write @KEY=VALUE \\(valid keys for hydra: heads, tree, budget, quant, format\\)"),
    ("hydra@heads=", "option 'heads' has no value"),
    ("hydra@heads=/no/such/dir", "heads directory '/no/such/dir' does not exist"),
    ("medusa@tree=/no/such/tree.json", "tree file '/no/such/tree.json' does not exist"),
    ("hydra@fixed@budget=auto", "option 'budget' is given twice"),
    ("llama-server@fixed", "a tree budget \\(@auto, @fixed\\) applies to medusa, hydra and eagle only; llama-server takes no"),
    ("eagle3@heads=x", "unknown bench method 'eagle3' in 'eagle3@heads=x'"),
    ("eagle@gamma=3", "option 'gamma' applies to sd, lookup and bpd only; valid keys for eagle: heads, tree, budget"),
])
def test_bad_method_spec_names_the_bad_part(spec, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_method(spec)
    with pytest.raises(ConfigError, match=msg):
        BenchConfig("t", "d", methods=("ar", spec))


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


# ------------------------------------------------------------------------------------------------
# peer rows, timing columns, same-as-own-plain, vs best peer (no peer runtime needed)
# ------------------------------------------------------------------------------------------------

EOS = 2


def _row(method, qid, tokens, wall, prefill, *, category="qa", new_tokens=None, eos=False, stats=None, timing=None):
    row = {"method": method, "question_id": qid, "category": category, "token_ids": tokens, "wall_s": wall,
           "prefill_s": prefill, "new_tokens": len(tokens) if new_tokens is None else new_tokens, "eos": eos,
           "text": " ".join(map(str, tokens))}
    if stats is not None:
        row["stats"] = stats
    if timing is not None:
        row["timing"] = timing
    return row


def _synthetic_runs():
    ours = {"target_calls": 3, "accepted_per_call": [0, 0, 0], "drafted_positions": 0}
    looked = {"target_calls": 2, "accepted_per_call": [1, 1], "drafted_positions": 4}
    return [
        # ours: rows as run_bench stores them (cut at EOS, `eos` says it was there)
        _row("ar", 1, [5, 6], 1.0, 0.2, eos=True, stats=ours),
        _row("ar", 2, [7, 8, 9], 1.0, 0.5, category="rag", stats=ours),
        _row("lookup", 1, [5, 6], 0.5, 0.2, eos=True, stats=looked),
        _row("lookup", 2, [7, 8, 1], 0.5, 0.5, category="rag", stats=looked),  # differs from ar
        # llama-server lists the EOS it stopped at (raw rows; new_tokens counts the answer only)
        _row("llama-server", 1, [5, 6, EOS], 0.5, 0.1, new_tokens=2),
        _row("llama-server", 2, [7, 8, 9], 0.5, 0.1, category="rag"),
        # ... its ngram row does not: the same text, so the same output
        _row("llama-server+ngram", 1, [5, 6], 0.4, 0.2,
             timing={"prefill_s": 0.2, "draft_n": 4, "draft_n_accepted": 3}),
        _row("llama-server+ngram", 2, [7, 8, 9], 0.4, 0.2, category="rag",
             timing={"prefill_s": 0.2, "draft_n": 0, "draft_n_accepted": 0}),
        _row("openvino", 1, [5, 6, EOS], 2.0, 1.9, new_tokens=2),
        _row("openvino", 2, [7, 8, 9], 2.0, 1.9, category="rag"),
        _row("openvino+draft", 1, [5, 6], 1.0, 0.5,
             timing={"num_draft_tokens": 6, "num_accepted_tokens": 3, "num_generated_tokens": 3, "target_calls": 3}),
        _row("openvino+draft", 2, [7, 8, 9, EOS], 1.0, 0.5, category="rag", new_tokens=3,
             timing={"num_draft_tokens": 2, "num_accepted_tokens": 1, "num_generated_tokens": 4, "target_calls": 1}),
    ]


METHODS = ("ar", "lookup", "llama-server", "llama-server+ngram", "openvino", "openvino+draft")


def test_plain_of_each_runtime():
    assert [plain_of(m) for m in ("ar", "medusa:typical", "hydra+lookup@fixed", "hf-assisted")] == ["ar"] * 4
    assert [plain_of(m) for m in ("llama-server", "llama-server+draft", "llama-server+ngram")] == ["llama-server"] * 3
    assert [plain_of(m) for m in ("openvino", "openvino+lookup", "openvino+draft")] == ["openvino"] * 3
    assert [plain_of(m) for m in ("ar@quant=gguf", "auto@quant=gguf", "lookup@quant=none")] == \
        ["ar@quant=gguf", "ar@quant=gguf", "ar@quant=none"]


def test_summarize_with_peer_rows():
    s = summarize(_synthetic_runs(), METHODS, {EOS})
    assert list(s) == list(METHODS)
    # tokens/s with prefill and of decoding alone
    assert s["ar"]["tokens_per_s"] == pytest.approx(5 / 2.0)
    assert s["ar"]["decode_tokens_per_s"] == pytest.approx(5 / 1.3)
    assert s["llama-server"]["tokens_per_s"] == pytest.approx(5.0)
    assert s["llama-server"]["decode_tokens_per_s"] == pytest.approx(5 / 0.8)
    assert s["openvino"]["decode_tokens_per_s"] == pytest.approx(5 / 0.2)
    assert s["lookup"]["speedup"] == pytest.approx(2.0)
    assert s["lookup"]["decode_speedup"] == pytest.approx((5 / 0.3) / (5 / 1.3))
    # the best peer: by tokens/s llama-server+ngram (6.25), by decode tokens/s openvino (25)
    for m in METHODS:
        assert s[m]["best_peer"] == "llama-server+ngram" and s[m]["best_peer_decode"] == "openvino"
        assert s[m]["vs_best_peer"] == pytest.approx(s[m]["tokens_per_s"] / 6.25)
        assert s[m]["decode_vs_best_peer"] == pytest.approx(s[m]["decode_tokens_per_s"] / 25.0)
    assert s["llama-server+ngram"]["vs_best_peer"] == pytest.approx(1.0)
    assert s["ar"]["vs_best_peer"] == pytest.approx(0.4)
    # same as the runtime's own plain row, with or without a trailing EOS in either
    assert [(s[m]["plain"], s[m]["identical_to_plain"]) for m in METHODS] == [
        ("ar", 2), ("ar", 1), ("llama-server", 2), ("llama-server", 2), ("openvino", 2), ("openvino", 2)]
    assert [s[m]["identical_to_ar"] for m in METHODS] == [2, 1, 2, 2, 2, 2]
    # τ: the decoder's count (the EOS it stopped at included); α: accepted / drafted
    assert s["ar"]["tokens_per_call"] == pytest.approx(6 / 6) and s["ar"]["acceptance_rate"] == 0.0
    assert s["lookup"]["tokens_per_call"] == pytest.approx(6 / 4) and s["lookup"]["acceptance_rate"] == 0.5
    assert s["llama-server+ngram"]["acceptance_rate"] == pytest.approx(0.75)
    assert s["llama-server+ngram"]["tokens_per_call"] == 0.0 and s["llama-server"]["acceptance_rate"] == 0.0
    assert s["openvino+draft"]["acceptance_rate"] == pytest.approx(4 / 8)
    assert s["openvino+draft"]["tokens_per_call"] == pytest.approx(7 / 4)
    assert s["ar"]["tokens_per_s_by_category"] == {"qa": pytest.approx(2.0), "rag": pytest.approx(3.0)}
    assert s["ar"]["prefill_s"] == pytest.approx(0.7) and s["ar"]["prompts"] == 2


def test_summarize_without_peers_or_their_plain_row():
    runs = _synthetic_runs()
    s = summarize(runs, ("ar", "lookup"), {EOS})
    assert s["ar"]["best_peer"] is None and s["lookup"]["vs_best_peer"] is None
    s = summarize(runs, ("ar", "llama-server+ngram", "openvino+draft"), {EOS})
    assert s["llama-server+ngram"]["identical_to_plain"] is None and s["openvino+draft"]["identical_to_plain"] is None
    assert s["ar"]["best_peer"] == "llama-server+ngram" and s["ar"]["best_peer_decode"] == "llama-server+ngram"
    # without the EOS id a trailing EOS is just a token: the outputs differ
    s = summarize(runs, METHODS, ())
    assert s["llama-server+ngram"]["identical_to_plain"] == 1 and s["openvino+draft"]["identical_to_plain"] == 0


def test_summary_table_fits_80_columns(capsys):
    s = summarize(_synthetic_runs(), METHODS, {EOS})
    print_summary(s, "speculant bench: a title that is fairly long, long enough to be wrapped at eighty columns")
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in out
    header = next(i for i, line in enumerate(lines) if line.startswith("method"))
    # two-line headers, every word whole
    assert lines[header - 1].split() == ["decode", "decode", "vs", "decode"]
    assert lines[header].split() == ["method", "tok/s", "tok/s", "vs", "ar", "vs", "ar", "peer", "vs", "peer",
                                     "τ", "α", "same"]
    text = " ".join(out.split())  # the legend and notes wrap at 80 columns
    assert "τ: tokens per target call" in text and "same: outputs equal to the plain row" in text
    assert "best peer: llama-server+ngram (6.25 tok/s" in text and "by decode tok/s: openvino (25.00)" in text
    assert "tokens/s by category" in text and "rag" in text
    rows = {line.split()[0]: line.split() for line in lines[header + 2: header + 2 + len(METHODS)]}
    assert list(rows) == list(METHODS)
    assert rows["lookup"][-1] == "1/2" and rows["llama-server+ngram"][-1] == "2/2"
    assert rows["lookup"][1:4] == ["5.00", "16.67", "2.00x"]


def test_summary_table_folds_long_method_specs(capsys):
    long = "hydra+lookup@heads=/a/rather/long/path/to/some/heads"
    runs = [dict(r, method=long) if r["method"] == "lookup" else r for r in _synthetic_runs()]
    print_summary(summarize(runs, ("ar", long), {EOS}), "t")
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80 and "…" not in out
    assert "some/heads" in out.replace(" ", "").replace("\n", "")


def test_bench_config_accepts_the_peer_rows():
    BenchConfig("t", "d", methods=("ar", *PEERS))
    assert set(PEERS) == {"hf-assisted", "llama-server", "llama-server+draft", "llama-server+ngram",
                          "llama-server+ngram-mod", "llama-server+ngram-map-k", "openvino", "openvino+lookup", "openvino+draft"}
    for methods, msg in [(("ar", "llamacpp"), "unknown bench method"), (("ar", "llama-server+eagle"), "unknown"),
                         (("ar", "openvino:typical"), "own methods"), (("ar", "openvino+lookup@fixed"), "medusa, hydra and eagle"),
                         (("llama-server",), "baseline")]:
        with pytest.raises(ConfigError, match=msg):
            BenchConfig("t", "d", methods=methods)


# ------------------------------------------------------------------------------------------------
# run_bench on tiny models: skipped peers, a fake llama-server, closing on errors
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny import tiny_llama, tiny_model_dir

    root = tmp_path_factory.mktemp("bench-models")
    target = tiny_model_dir(root / "target", seed=0)
    draft = tiny_model_dir(root / "draft", seed=1, base=tiny_llama(0, scale=4.0), noise=0.3)
    questions = root / "questions.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [text]}) + "\n"
                                 for i, text in enumerate(["w1 w2 w3 w4 w1 w2", "w5 w6 w7 w5 w6"], start=1)))
    return {"target": str(target), "draft": str(draft), "questions": str(questions)}


def _cfg(tiny, methods, tmp_path, **kw):
    kw = {"dtype": "float32", **kw}
    return BenchConfig(tiny["target"], tiny["draft"], methods=methods, per_category=2, max_new_tokens=6,
                       categories=("qa",), questions=tiny["questions"], json_out=str(tmp_path / "bench.json"), **kw)


def test_unavailable_peers_are_skipped_and_the_rest_runs(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(harness, "llama_server_unavailable", lambda: "llama-server is not installed; make it")
    monkeypatch.setattr(harness, "openvino_unavailable", lambda draft=True, **kw: "no OpenVINO venv; make install-openvino")
    res = run_bench(_cfg(tiny, ("ar", "llama-server+ngram", "lookup", "openvino", "hf-assisted", "openvino+draft"),
                         tmp_path), command="speculant bench --methods ...")
    err = capsys.readouterr().err
    assert "skipping the llama-server+ngram row: llama-server is not installed; make it" in err
    assert "skipping the openvino+draft row: no OpenVINO venv; make install-openvino" in err
    assert set(res["skipped"]) == {"llama-server+ngram", "openvino", "openvino+draft"}
    assert list(res["summary"]) == ["ar", "lookup", "hf-assisted"] and list(res["peers"]) == ["hf-assisted"]
    assert res["summary"]["lookup"]["identical_to_plain"] == 2 and res["summary"]["ar"]["best_peer"] == "hf-assisted"
    assert res["summary"]["hf-assisted"]["plain"] == "ar" and res["summary"]["hf-assisted"]["identical_to_plain"] == 2
    saved = json.loads(Path(tmp_path / "bench.json").read_text())
    assert saved["command"] == "speculant bench --methods ..." and saved["date"].endswith("+00:00")
    assert set(saved["machine"]) == {"cpu", "flags", "cores", "threads", "torch"}
    assert "commit" in saved and "dirty" in saved and saved["eos_token_ids"] == [EOS]
    for row in saved["runs"]:
        assert row["prefill_s"] > 0 and row["decode_tokens_per_s"] > row["tokens_per_s"] > 0
        assert (row["stats"] if row["method"] != "hf-assisted" else row["timing"])["prefill_s"] == row["prefill_s"]
        assert EOS not in row["token_ids"] and row["new_tokens"] == len(row["token_ids"])


def test_rows_on_another_quantization_of_the_target_run_side_by_side(tiny, tmp_path):
    """``@quant=Q``: the row runs on a native target of that quantization (one, shared), and its
    output is compared with ``ar@quant=Q``'s."""
    res = run_bench(_cfg(tiny, ("ar", "lookup", "ar@quant=int8", "lookup@quant=int8"), tmp_path, dtype="bfloat16",
                         backend="native"))
    s = res["summary"]
    assert s["lookup@quant=int8"]["plain"] == "ar@quant=int8" and s["lookup@quant=int8"]["identical_to_plain"] == 2
    assert s["lookup"]["plain"] == "ar" and s["lookup"]["identical_to_plain"] == 2
    runs = {(r["method"], r["question_id"]): r["token_ids"] for r in res["runs"]}
    assert all(runs[("ar@quant=int8", q)] for q in (1, 2))


def test_cli_bench_records_its_command(tiny, tmp_path, capsys):
    from speculant.cli.commands import main

    argv = ["bench", "--target", tiny["target"], "--draft", tiny["draft"], "--methods", "ar,lookup", "--dtype",
            "float32", "--questions", tiny["questions"], "--categories", "qa", "--max-new-tokens", "4",
            "--json-out", str(tmp_path / "cli.json")]
    assert main(argv) == 0, capsys.readouterr().err
    saved = json.loads((tmp_path / "cli.json").read_text())
    assert saved["command"].startswith("speculant bench --target ") and saved["command"].endswith("cli.json")
    assert list(saved["summary"]) == ["ar", "lookup"]


def test_openvino_needs_the_targets_ir(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "openvino_unavailable", lambda draft=True, **kw: None)  # the venv is there
    res = run_bench(_cfg(tiny, ("ar", "openvino"), tmp_path))
    assert "no OpenVINO IR of " + tiny["target"] in res["skipped"]["openvino"]
    assert "tools/install_openvino.py --model " + tiny["target"] in res["skipped"]["openvino"]


class FakeServer:
    """Stands in for LlamaServer: plain greedy 'decoding' that answers w1 w2 EOS (ngram: without the
    EOS, as a runtime that does not list it would), with made-up timings; records start and close."""
    instances: list = []
    fail_at: int | None = None
    error = RuntimeError

    def __init__(self, config, target, draft):
        self.config, self.binary, self.target, self.n_threads, self.n_ctx, self.port = \
            config, Path("/nonexistent/llama-server"), Path(target), 1, 4096, None
        self.draft = Path(draft) if config == "draft" else None
        self.calls, self.closed = 0, False
        FakeServer.instances.append(self)

    def args(self, port):
        spec = ["--spec-type", "ngram-simple"] if self.config == "ngram" else []
        return [str(self.binary), "--port", str(port), *spec]

    def run(self, ids, n):
        self.calls += 1
        if FakeServer.fail_at is not None and self.calls >= FakeServer.fail_at:
            raise FakeServer.error("the server went away")
        out = [4, 5] if self.config == "ngram" else [4, 5, EOS]
        return out[:n], 0.05, {"prefill_s": 0.01, "decode_s": 0.04, "draft_n": 2, "draft_n_accepted": 1}

    def close(self):
        self.closed = True


@pytest.fixture
def fake_server(monkeypatch):
    from speculant.bench import pair

    monkeypatch.setattr(harness, "llama_server_unavailable", lambda: None)
    monkeypatch.setattr(harness, "LlamaServer", FakeServer)
    monkeypatch.setattr(pair, "gguf_path", lambda spec: Path(spec) / "model.gguf")  # the tiny models have none
    FakeServer.instances, FakeServer.fail_at, FakeServer.error = [], None, RuntimeError
    return FakeServer


def test_peer_rows_run_and_are_closed(tiny, tmp_path, fake_server, capsys):
    res = run_bench(_cfg(tiny, ("ar", "llama-server", "llama-server+ngram"), tmp_path))
    assert [s.config for s in fake_server.instances] == ["plain", "ngram"]
    assert all(s.closed for s in fake_server.instances)
    assert all(s.calls == 3 for s in fake_server.instances)  # warm-up + 2 prompts
    s = res["summary"]
    assert s["llama-server+ngram"]["identical_to_plain"] == 2 and s["llama-server+ngram"]["plain"] == "llama-server"
    assert s["llama-server"]["tokens_per_s"] == pytest.approx(2 / 0.05)
    assert s["llama-server"]["decode_tokens_per_s"] == pytest.approx(2 / 0.04)
    assert s["llama-server+ngram"]["acceptance_rate"] == pytest.approx(0.5)
    assert s["ar"]["vs_best_peer"] == pytest.approx(s["ar"]["tokens_per_s"] / (2 / 0.05))
    assert res["peers"]["llama-server+ngram"]["args"][-2:] == ["--spec-type", "ngram-simple"]
    assert res["peers"]["llama-server"]["version"] is None  # no such binary
    assert res["best_peer"]["tokens_per_s"] in ("llama-server", "llama-server+ngram")
    rows = [r for r in res["runs"] if r["method"] == "llama-server"]
    assert all(r["token_ids"] == [4, 5] and r["eos"] and r["new_tokens"] == 2 for r in rows)
    assert all(r["timing"]["draft_n"] == 2 and r["prefill_s"] == 0.01 for r in rows)
    out = capsys.readouterr().out
    assert "best peer: llama-server" in out and "vs peer" in out


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_peers_are_closed_on_error(tiny, tmp_path, fake_server, error):
    fake_server.fail_at, fake_server.error = 2, error  # the warm-up works, the first prompt fails
    with pytest.raises(error, match="went away"):
        run_bench(_cfg(tiny, ("ar", "llama-server", "llama-server+draft"), tmp_path))
    assert len(fake_server.instances) == 2 and all(s.closed for s in fake_server.instances)


# ------------------------------------------------------------------------------------------------
# bench-report: a saved JSON as Markdown, a README section, a plot
# ------------------------------------------------------------------------------------------------

def _saved(directory, name="2026-01-02-some-cpu-bench.json", date="2026-01-02T03:04:05+00:00"):
    runs = _synthetic_runs()
    result = {"config": {"target": "tiny-target", "max_new_tokens": 128}, "command": "speculant bench --x 1",
              "date": date, "machine": {"cpu": "Some CPU 9000", "flags": ["avx2", "avx512_vnni", "fma"], "cores": 2},
              "commit": "0" * 40, "peers": {m: {} for m in METHODS if m in PEERS}, "runs": runs,
              "summary": summarize(runs, METHODS, {EOS})}
    path = directory / name
    path.write_text(json.dumps(result))
    return path


def _md_rows(text):
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| `")}


def test_bench_report_markdown(tmp_path, capsys):
    from speculant.cli.commands import main

    path = _saved(tmp_path)
    assert main(["bench-report", str(path), "--markdown"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("*Some CPU 9000 (avx512_vnni, no AMX; 2 cores), 2026-01-02; tiny-target, "
                               "2 Spec-Bench prompts x 128 new tokens. Command: `speculant bench --x 1` (the peer "
                               "rows: `make install-peers`).")
    assert lines[0].endswith(f"Raw data: [{path.name}]({path.as_posix()}).*")
    assert lines[2] == ("| method | tok/s | decode tok/s | vs `ar` | vs best peer | decode vs best peer | τ "
                        "| same as plain |")
    rows = _md_rows(out)
    assert list(rows) == ["`ar` (speculant, plain decoding)", "`lookup` (speculant, prompt lookup)",
                          "`llama-server` (llama.cpp, plain)", "`llama-server+ngram` (llama.cpp, n-gram lookup)",
                          "`openvino` (OpenVINO GenAI, plain)", "`openvino+draft` (OpenVINO GenAI, draft model)"]
    assert rows["`ar` (speculant, plain decoding)"] == ["2.50", "3.85", "1.00x", "0.40x", "0.15x", "1.00", "2/2"]
    assert rows["`lookup` (speculant, prompt lookup)"] == ["5.00", "16.67", "2.00x", "0.80x", "0.67x", "1.50", "1/2"]
    assert rows["`llama-server+ngram` (llama.cpp, n-gram lookup)"] == ["**6.25**", "12.50", "2.50x", "1.00x",
                                                                     "0.50x", "–", "2/2"]
    assert rows["`openvino` (OpenVINO GenAI, plain)"][1] == "**25.00**"
    assert "Same as plain: prompts whose output equals plain decoding on the same runtime" in out
    assert "every speculant row matches it" not in out  # lookup differs on one prompt


def test_bench_report_reads_a_summary_without_decode_rates(tmp_path):
    path = _saved(tmp_path)
    old = json.loads(path.read_text())
    keep = ("speedup", "tokens_per_s", "tokens_per_call", "identical_to_ar", "prompts")
    old["summary"] = {m: {k: v for k, v in s.items() if k in keep} for m, s in old["summary"].items()}
    old["resolved"] = {"lookup": {"method": "lookup", "why": "test"}}
    path.write_text(json.dumps(old))
    rows = _md_rows(markdown_table(load_result(path)))
    assert rows["`lookup` (speculant, prompt lookup: lookup)"] == ["5.00", "–", "2.00x", "0.80x", "–", "1.50", "1/2"]
    assert rows["`llama-server+ngram` (llama.cpp, n-gram lookup)"][-1] == "–"


def test_bench_report_update_readme(tmp_path, capsys):
    from speculant.cli.commands import main

    (tmp_path / "benchmarks").mkdir()
    path = _saved(tmp_path / "benchmarks")
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n")
    assert main(["bench-report", str(path), "--update-readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith(f"# title\n\nbefore\n{BEGIN}\n*Some CPU 9000") and text.endswith(f"{END}\nafter\n")
    assert "old table" not in text and f"](benchmarks/{path.name})" in text
    assert "| `lookup` (speculant, prompt lookup) | 5.00 |" in text
    assert main(["bench-report", str(path), "--update-readme", str(readme)]) == 0
    assert readme.read_text() == text  # the same again
    readme.write_text("no markers here\n")
    assert main(["bench-report", str(path), "--update-readme", str(readme)]) == 2
    assert "has no '<!-- results:begin -->' ... '<!-- results:end -->' pair" in capsys.readouterr().err
    assert readme.read_text() == "no markers here\n"
    with pytest.raises(ConfigError, match="put both markers"):
        update_readme(readme, load_result(path), path)


def test_bench_report_defaults_to_the_newest_json(tmp_path, monkeypatch, capsys):
    from speculant.cli.commands import main

    bench = tmp_path / "benchmarks"
    bench.mkdir()
    _saved(bench, "2026-01-02-a-bench.json", "2026-01-02T00:00:00+00:00")
    newest = _saved(bench, "2026-03-04-b-bench.json", "2026-03-04T00:00:00+00:00")
    (bench / "2026-05-06-a-quant-eval.json").write_text(json.dumps({"results": {}}))  # not a bench result
    capped = _saved(bench, "2026-07-08-c-bench.json", "2026-07-08T00:00:00+00:00")  # newer, but run with fewer ISAs
    result = json.loads(capped.read_text())
    result["machine"]["env"] = {"SPECULANT_NO_AMX": "1"}
    capped.write_text(json.dumps(result))
    assert newest_result(bench) == newest
    monkeypatch.chdir(tmp_path)
    assert main(["bench-report"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80 and "2026-03-04" in out and "lookup" in out
    with pytest.raises(ConfigError, match="no bench JSON in"):
        newest_result(tmp_path / "empty")
    assert main(["bench-report", str(bench / "2026-05-06-a-quant-eval.json"), "--markdown"]) == 2
    assert "is not a bench result" in capsys.readouterr().err


def test_bench_report_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from speculant.cli.commands import main

    path, png = _saved(tmp_path), tmp_path / "bench.png"
    assert main(["bench-report", str(path), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert main(["bench-report", str(path), "--plot", str(tmp_path / "bench.nope")]) == 2
    assert "unknown image type '.nope'" in capsys.readouterr().err
    assert main(["bench-report", str(path), "--plot", str(tmp_path / "no" / "dir.png")]) == 2
    assert "no directory" in capsys.readouterr().err


def test_bench_plot_option(tiny, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from speculant.cli.commands import main

    png = tmp_path / "run.png"
    argv = ["bench", "--target", tiny["target"], "--draft", tiny["draft"], "--methods", "ar,lookup@gamma=2",
            "--dtype", "float32", "--questions", tiny["questions"], "--categories", "qa", "--max-new-tokens", "4",
            "--json-out", str(tmp_path / "run.json"), "--plot", str(png)]
    assert main(argv) == 0, capsys.readouterr().err
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert list(json.loads((tmp_path / "run.json").read_text())["summary"]) == ["ar", "lookup@gamma=2"]


# ------------------------------------------------------------------------------------------------
# end to end with the real peers (skipped unless both are installed)
# ------------------------------------------------------------------------------------------------

@pytest.mark.real
def test_bench_with_real_peers(tmp_path):
    from speculant.bench.llama_server import llama_server_unavailable
    from speculant.bench.openvino import openvino_unavailable

    why = llama_server_unavailable() or openvino_unavailable(draft=False)
    if why:
        pytest.skip(f"peer not installed: {why}")
    out = tmp_path / "bench.json"
    res = run_bench(BenchConfig("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct",
                                methods=("ar", "llama-server", "openvino"), per_category=1, categories=("qa",),
                                max_new_tokens=8, json_out=str(out)), command="speculant bench (test)")
    saved = json.loads(out.read_text())
    assert list(saved["summary"]) == ["ar", "llama-server", "openvino"] and saved["skipped"] == {}
    assert saved["command"] == "speculant bench (test)" and saved["machine"]["cpu"] and saved["machine"]["cores"] >= 1
    assert saved["commit"] is None or len(saved["commit"]) == 40
    assert saved["peers"]["llama-server"]["version"] and "--cache-ram" in saved["peers"]["llama-server"]["args"]
    assert saved["peers"]["openvino"]["worker"]["versions"]["openvino_genai"]
    assert saved["best_peer"]["tokens_per_s"] in ("llama-server", "openvino")
    for row in saved["runs"]:
        assert 0 < row["prefill_s"] < row["wall_s"] and row["decode_tokens_per_s"] > row["tokens_per_s"] > 0
        assert 1 <= row["new_tokens"] <= 8 and len(row["token_ids"]) == row["new_tokens"]
    for m, s in saved["summary"].items():
        assert s["identical_to_plain"] == 1 and s["vs_best_peer"] > 0, m
    assert res["summary"]["ar"]["plain"] == "ar"


def test_machine_line_names_the_instruction_sets():
    from speculant.bench.report import machine_line

    assert machine_line({"machine": {"cpu": "AMD EPYC", "flags": ["avx2", "fma"], "cores": 2}}) == \
        "AMD EPYC (avx2, no AVX-512, no AMX; 2 cores)"
    assert machine_line({"machine": {"cpu": "X", "flags": ["avx2", "avx512f", "avx512_bf16", "amx_tile"], "cores": 2}}) == \
        "X (avx512_bf16, amx_tile; 2 cores)"
    assert machine_line({"machine": {"cpu": "X", "flags": ["avx2", "avx512f", "avx512_vnni"]}}) == "X (avx512_vnni, no AMX)"
    assert machine_line({}) == "unknown CPU"
    assert machine_line({"machine": {"cpu": "X", "flags": ["avx512f", "amx_tile"], "cores": 2,
                                     "env": {"SPECULANT_NO_AMX": "1"}}}) == "X (amx_tile; 2 cores; run with SPECULANT_NO_AMX=1)"


def test_machine_info_records_what_caps_the_instruction_sets(monkeypatch):
    from speculant.bench.harness import CAPPING_ENV, machine_info

    for k in CAPPING_ENV:
        monkeypatch.delenv(k, raising=False)
    assert "env" not in machine_info()
    monkeypatch.setenv("SPECULANT_NO_AMX", "1")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert machine_info()["env"] == {"SPECULANT_NO_AMX": "1", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}


def test_bench_at_a_temperature(tiny, tmp_path, capsys):
    """--temperature: every row samples (each prompt its own seed, the same for every row), the
    peers are skipped with the reason, outputs are not compared, and each run's target NLL is the
    mean -log p_T of its tokens under the target at that temperature."""
    import torch
    from transformers import AutoModelForCausalLM

    res = run_bench(_cfg(tiny, ("ar", "lookup", "hf-assisted"), tmp_path, temperature=0.8, seed=5))
    assert "greedy only" in res["skipped"]["hf-assisted"]
    assert res["config"]["temperature"] == 0.8
    for m in ("ar", "lookup"):
        s = res["summary"][m]
        assert s["identical_to_plain"] is None and s["target_nll"] > 0
    model = AutoModelForCausalLM.from_pretrained(tiny["target"], torch_dtype=torch.float32).eval()
    # recompute one run's NLL with transformers from the prompt the bench encoded
    from speculant.bench.harness import select
    from speculant.specbench import load_questions
    from speculant.store.chat import chat_prompt
    from speculant.store.models import load
    tok = load(tiny["target"], "float32").tokenizer
    q = select(load_questions(tiny["questions"]), 2, ("qa",))[0]
    ids = tok(chat_prompt(tok, q["turns"][0]), add_special_tokens=False, return_tensors="pt").input_ids[0]
    row = next(r for r in res["runs"] if r["method"] == "ar" and r["question_id"] == q["question_id"])
    full = torch.cat([ids, torch.tensor(row["token_ids"], dtype=torch.long)])
    with torch.no_grad():
        lp = (model(full[None]).logits[0].float() / 0.8).log_softmax(-1)
    n0 = ids.shape[0]
    want = -lp[n0 - 1:-1].gather(1, full[n0:, None]).mean().item()
    assert abs(row["target_nll"] - want) < 1e-3
    assert "nll:" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="temperature"):
        _cfg(tiny, ("ar",), tmp_path, temperature=-1.0)


def test_results_say_where_they_come_from_and_the_readme_takes_clean_runs_only(tmp_path):
    """A run from a tree with uncommitted changes records the diff's hash (and a source that
    changed during the run says so); the README's table refuses such a run."""
    from speculant.bench.harness import provenance, provenance_warning

    clean = {"commit": "a" * 40, "dirty": False}
    edited = {"commit": "a" * 40, "dirty": True, "diff_sha256": "d" * 64}
    assert provenance(clean, clean) == clean and provenance_warning(clean) is None
    during = provenance(clean, edited)
    assert during["dirty"] and during["changed_during_run"] and "changed while the bench ran" in \
        provenance_warning(during)
    stayed = provenance(edited, edited)
    assert stayed["diff_sha256"] == "d" * 64 and "changed_during_run" not in stayed
    assert "uncommitted changes (diff sha256 dddddddddddd)" in provenance_warning(stayed)
    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\nold\n{END}\n")
    (tmp_path / "b").mkdir()
    path = _saved(tmp_path / "b")
    result = {**load_result(path), **stayed}
    with pytest.raises(ConfigError, match="uncommitted changes"):
        update_readme(readme, result, path)
    assert readme.read_text() == f"{BEGIN}\nold\n{END}\n"


def test_the_auto_row_drafts_with_a_draft_the_user_gave(tiny, tmp_path):
    # as `speculant generate --draft D` does: with --draft the planner may choose the draft model;
    # without it (the default pair's sibling draft, given for the rows that draft) auto plans alone
    given = run_bench(_cfg(tiny, ("ar", "auto"), tmp_path, auto_draft=True))
    alone = run_bench(_cfg(tiny, ("ar", "auto"), tmp_path))
    assert given["resolved"]["auto"]["method"].startswith(("sd", "mcsd"))
    assert not alone["resolved"]["auto"]["method"].startswith(("sd", "mcsd"))
