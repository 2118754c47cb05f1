"""The bench harness: method names with acceptance rules, the quality scores (BLEU on
translation, exact match of the final number on math_reasoning), the summary with peer rows
(same as own plain, vs best peer, decode-only rates), skipped and fake peers on tiny models, and
one end-to-end run with the real peers (``real``; skipped unless both are installed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculant.bench import harness
from speculant.bench.harness import (PEERS, BenchConfig, final_number, plain_of, print_summary, quality_scores,
                                     run_bench, split_method, summarize, tree_budget_of)
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


def test_summary_table_is_not_truncated(capsys):
    s = summarize(_synthetic_runs(), METHODS, {EOS})
    print_summary(s, "speculant bench: a title that is fairly long, to see that nothing is squeezed")
    out = capsys.readouterr().out
    for header in ("method", "tok/s", "decode tok/s", "vs ar", "decode vs ar", "vs best peer",
                   "decode vs best peer", "τ", "α", "same as plain"):
        assert header in out
    assert "…" not in out
    assert "best peer: llama-server+ngram (6.25 tok/s" in out and "by decode tok/s: openvino (25.00)" in out
    assert "tokens/s by category" in out and "rag" in out
    assert "2/2 (llama-server)" in out and "1/2 (ar)" in out


def test_bench_config_accepts_the_peer_rows():
    BenchConfig("t", "d", methods=("ar", *PEERS))
    assert set(PEERS) == {"hf-assisted", "llama-server", "llama-server+draft", "llama-server+ngram",
                          "openvino", "openvino+lookup", "openvino+draft"}
    for methods, msg in [(("ar", "llamacpp"), "unknown bench method"), (("ar", "llama-server+eagle"), "unknown"),
                         (("ar", "openvino:typical"), "own methods"), (("ar", "openvino+lookup@fixed"), "medusa and"),
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
    return BenchConfig(tiny["target"], tiny["draft"], methods=methods, per_category=2, max_new_tokens=6,
                       dtype="float32", categories=("qa",), questions=tiny["questions"],
                       json_out=str(tmp_path / "bench.json"), **kw)


def test_unavailable_peers_are_skipped_and_the_rest_runs(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(harness, "llama_server_unavailable", lambda: "llama-server is not installed; make it")
    monkeypatch.setattr(harness, "openvino_unavailable", lambda draft=True: "no OpenVINO venv; make install-openvino")
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


def test_cli_bench_records_its_command(tiny, tmp_path, capsys):
    from speculant.cli import main

    argv = ["bench", "--target", tiny["target"], "--draft", tiny["draft"], "--methods", "ar,lookup", "--dtype",
            "float32", "--questions", tiny["questions"], "--categories", "qa", "--max-new-tokens", "4",
            "--json-out", str(tmp_path / "cli.json")]
    assert main(argv) == 0, capsys.readouterr().err
    saved = json.loads((tmp_path / "cli.json").read_text())
    assert saved["command"].startswith("speculant bench --target ") and saved["command"].endswith("cli.json")
    assert list(saved["summary"]) == ["ar", "lookup"]


def test_openvino_needs_its_preset_target(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "openvino_unavailable", lambda draft=True: None)
    res = run_bench(_cfg(tiny, ("ar", "openvino"), tmp_path))
    assert "int4 IR of qwen2.5-coder-1.5b-instruct only" in res["skipped"]["openvino"]


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
    monkeypatch.setattr(harness, "llama_server_unavailable", lambda: None)
    monkeypatch.setattr(harness, "LlamaServer", FakeServer)
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
    assert "best peer: llama-server" in out and "decode vs best peer" in out


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_peers_are_closed_on_error(tiny, tmp_path, fake_server, error):
    fake_server.fail_at, fake_server.error = 2, error  # the warm-up works, the first prompt fails
    with pytest.raises(error, match="went away"):
        run_bench(_cfg(tiny, ("ar", "llama-server", "llama-server+draft"), tmp_path))
    assert len(fake_server.instances) == 2 and all(s.closed for s in fake_server.instances)


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
