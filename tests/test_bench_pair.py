"""`speculant bench --target X --draft Y` for any pair (speculant.bench.pair): the files each peer row
runs (llama-server: the same GGUF files, -m and -md; OpenVINO: the IR exported for them), the rows
skipped with one line (a transformers directory has no GGUF, no IR exported, no --draft), and the
one-line errors for a bad pair (other vocabulary, draft larger than the target, no such file) raised
before any model loads. Tiny random-weight models (tests/tiny.py, test_models' GGUF writer); the
rows are planned, not run, except in the one test that needs a built llama-server (skipped when
there is none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from speculant.bench import harness, llama_server, pair
from speculant.bench.harness import BenchConfig, run_bench
from speculant.bench.llama_server import LlamaServer, llama_server_unavailable
from speculant.bench.openvino import ir_dir
from speculant.bench.pair import check_pair, check_spec, plan_peers
from speculant.errors import ConfigError, VocabMismatchError

ROWS = ("llama-server", "llama-server+draft", "llama-server+ngram", "openvino", "openvino+lookup",
        "openvino+draft", "hf-assisted")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A GGUF pair of one vocabulary (target 4 layers, draft 2), a GGUF of another vocabulary, a
    GGUF larger than the target, and two transformers directories of one word vocabulary."""
    from test_models import _write_tiny_gguf
    from tiny import tiny_llama, tiny_model_dir

    root = tmp_path_factory.mktemp("pair")
    return {
        "target": _write_tiny_gguf(root / "target.gguf", layers=4),
        "draft": _write_tiny_gguf(root / "draft.gguf", layers=2),
        "other_vocab": _write_tiny_gguf(root / "other.gguf", vocab_size=72, layers=2),
        "larger": _write_tiny_gguf(root / "larger.gguf", layers=6),
        "dir_target": tiny_model_dir(root / "dir-target", seed=0),
        "dir_draft": tiny_model_dir(root / "dir-draft", seed=1, base=tiny_llama(0, scale=4.0), noise=0.3),
    }


@pytest.fixture
def fake_binary(tmp_path, monkeypatch):
    """llama-server 'installed': an executable file stands in for it (never started)."""
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\nexit 1\n")
    binary.chmod(0o755)
    monkeypatch.setattr(llama_server, "llama_server_binary", lambda: binary)
    return binary


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


# ------------------------------------------------------------------------------------------------
# the peer rows' files
# ------------------------------------------------------------------------------------------------

def test_llama_server_rows_run_the_given_gguf_files(models, fake_binary):
    plans = plan_peers(ROWS[:3], models["target"], models["draft"])
    assert plans["llama-server"] == pair.PeerFiles(models["target"], None)
    assert plans["llama-server+ngram"] == pair.PeerFiles(models["target"], None)
    assert plans["llama-server+draft"] == pair.PeerFiles(models["target"], models["draft"])
    for row, config in [("llama-server", "plain"), ("llama-server+draft", "draft"), ("llama-server+ngram", "ngram")]:
        args = LlamaServer(config, target=plans[row].target, draft=plans[row].draft).args(8080)
        assert args[0] == str(fake_binary) and _flag(args, "-m") == str(models["target"])
        assert _flag(args, "-md") == (str(models["draft"]) if config == "draft" else None)
        assert _flag(args, "--spec-type") == {"plain": None, "draft": "draft-simple", "ngram": "ngram-simple"}[config]


def test_a_transformers_directory_has_no_gguf_for_llama_server(models):
    plans = plan_peers(("llama-server", "llama-server+draft", "hf-assisted"), models["dir_target"], models["dir_draft"])
    for row in ("llama-server", "llama-server+draft"):
        why = plans[row].skip
        assert why.startswith("llama-server runs GGUF files, and the target ") and str(models["dir_target"]) in why
        assert "\n" not in why and "convert_hf_to_gguf.py" in why
    assert plans["hf-assisted"] == pair.PeerFiles()  # transformers runs the directories themselves
    # a GGUF target with a directory draft: plain llama-server runs, the draft row names the draft
    plans = plan_peers(("llama-server", "llama-server+draft"), models["target"], models["dir_draft"])
    assert plans["llama-server"] == pair.PeerFiles(models["target"], None)
    assert "the draft " + str(models["dir_draft"]) in plans["llama-server+draft"].skip


def test_openvino_rows_run_the_ir_exported_for_the_pair(models, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))  # the IR made here stays in this test
    plans = plan_peers(("openvino", "openvino+draft"), models["target"], models["draft"])
    for row in ("openvino", "openvino+draft"):  # nothing exported yet: skipped with the command that does it
        assert f"no OpenVINO IR of {models['target']} at {ir_dir(models['target'])}" in plans[row].skip
        assert f"tools/install_openvino.py --model {models['target']}" in plans[row].skip
    for spec in ("target", "draft"):
        ir_dir(models[spec]).mkdir(parents=True)
        (ir_dir(models[spec]) / "openvino_model.xml").write_text("<net/>")
    plans = plan_peers(("openvino", "openvino+lookup", "openvino+draft"), models["target"], models["draft"])
    assert plans["openvino"] == plans["openvino+lookup"] == pair.PeerFiles(ir_dir(models["target"]), None)
    assert plans["openvino+draft"] == pair.PeerFiles(ir_dir(models["target"]), ir_dir(models["draft"]))
    assert ir_dir(models["target"]) != ir_dir(models["draft"])
    assert ir_dir("qwen2.5-coder-1.5b-instruct").name == "qwen2.5-coder-1.5b-instruct-int4"  # a preset's, as before


def test_without_a_draft_the_rows_that_draft_are_skipped(models):
    plans = plan_peers(ROWS, models["target"], None)
    assert {r for r, p in plans.items() if p.skip and p.skip.startswith("no --draft")} == \
        {"llama-server+draft", "openvino+draft", "hf-assisted"}
    assert plans["llama-server"] == pair.PeerFiles(models["target"], None)


# ------------------------------------------------------------------------------------------------
# bad pairs and missing files: one line, before anything loads
# ------------------------------------------------------------------------------------------------

def test_check_pair(models):
    check_pair(models["target"], models["draft"])  # one vocabulary, the draft smaller
    check_pair(models["dir_target"], models["dir_draft"])
    with pytest.raises(VocabMismatchError, match="different vocabularies") as e:
        check_pair(models["target"], models["other_vocab"])
    assert "\n" not in str(e.value)
    with pytest.raises(VocabMismatchError):  # a word vocabulary against the GGUF's
        check_pair(models["target"], models["dir_draft"])
    with pytest.raises(ConfigError, match=r"the draft 'larger.gguf' \(6 layers x 32\) is larger than the target "
                                          r"'target.gguf' \(4 layers x 32\)") as e:
        check_pair(models["target"], models["larger"])
    assert "\n" not in str(e.value) and "sibling-drafts" in str(e.value)


def test_check_spec(tmp_path):
    check_spec("qwen2.5-coder-1.5b-instruct", "--target")  # a preset: nothing read
    with pytest.raises(ConfigError, match="--draft .*nope.gguf: no such file or directory"):
        check_spec(tmp_path / "nope.gguf", "--draft")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match="is not a GGUF file"):
        check_spec(tmp_path / "notes.txt", "--target")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="without config.json.*pass .*m.gguf"):
        check_spec(tmp_path / "d", "--target")


@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading or running a model fails the test: the bench must stop before."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded")

    for name in ("choose_runtime", "load", "load_native", "load_adapted", "SpeculativeDecoder"):
        monkeypatch.setattr(harness, name, refuse)


@pytest.mark.parametrize("draft, error, msg", [("other_vocab", VocabMismatchError, "different vocabularies"),
                                               ("larger", ConfigError, "is larger than the target"),
                                               ("missing", ConfigError, "no such file or directory")])
def test_bad_pairs_fail_before_any_model_loads(models, tmp_path, nothing_loads, draft, error, msg):
    spec = tmp_path / "missing.gguf" if draft == "missing" else models[draft]
    cfg = BenchConfig(str(models["target"]), str(spec), methods=("ar", "sd", "llama-server"))
    with pytest.raises(error, match=msg):
        run_bench(cfg)


def test_cli_says_it_in_one_line(models, nothing_loads, capsys):
    from speculant.cli.commands import main

    assert main(["bench", "--target", str(models["target"]), "--draft", str(models["other_vocab"]),
                 "--methods", "ar,sd"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("speculant: error: the draft 'other.gguf'")


# ------------------------------------------------------------------------------------------------
# run_bench's plan: what each row gets (the run itself stubbed out)
# ------------------------------------------------------------------------------------------------

class PlannedServer:
    """Stands in for LlamaServer: records what the bench gives it."""
    made: list = []

    def __init__(self, config, target, draft):
        self.config, self.target, self.draft = config, target, draft
        PlannedServer.made.append(self)

    def close(self):
        pass


@pytest.fixture
def planned(monkeypatch):
    """run_bench up to the run: the peers' plan and the rows left, returned instead of a result."""
    monkeypatch.setattr(harness, "llama_server_unavailable", lambda: None)
    monkeypatch.setattr(harness, "openvino_unavailable", lambda draft=True, **kw: None)
    monkeypatch.setattr(harness, "LlamaServer", PlannedServer)
    monkeypatch.setattr(harness, "_run", lambda cfg, methods, peers, files, skipped, *rest:
                        {"methods": methods, "peers": peers, "files": files, "skipped": skipped})
    PlannedServer.made = []
    return PlannedServer


def test_the_bench_plans_the_pair_for_every_row(models, planned):
    methods = ("ar", "sd", "lookup", *ROWS)
    res = run_bench(BenchConfig(str(models["target"]), str(models["draft"]), methods=methods))
    assert {(s.config, s.target, s.draft) for s in planned.made} == {
        ("plain", models["target"], None), ("draft", models["target"], models["draft"]),
        ("ngram", models["target"], None)}
    assert set(res["skipped"]) == {"openvino", "openvino+lookup", "openvino+draft"}  # no IR exported here
    assert res["methods"] == ["ar", "sd", "lookup", "llama-server", "llama-server+draft", "llama-server+ngram",
                              "hf-assisted"]


def test_another_target_without_a_draft_skips_the_rows_that_draft(models, planned, capsys):
    from speculant.cli.commands import main

    assert main(["bench", "--target", str(models["dir_target"]), "--methods",
                 "ar,sd,mcsd,lookup,llama-server,llama-server+draft,hf-assisted"]) == 0
    err = capsys.readouterr().err
    for row in ("sd", "mcsd", "llama-server+draft", "hf-assisted"):
        assert f"skipping the {row} row: no --draft was given for the target" in err
    assert "skipping the llama-server row: llama-server runs GGUF files" in err
    assert planned.made == []


# ------------------------------------------------------------------------------------------------
# with a built llama-server: the tiny GGUF pair really runs as the draft row
# ------------------------------------------------------------------------------------------------

@pytest.mark.real
@pytest.mark.skipif(llama_server_unavailable() is not None, reason=f"llama-server peer: {llama_server_unavailable()}")
def test_llama_server_drafts_with_the_given_draft_gguf(models):
    import torch

    files = plan_peers(("llama-server+draft",), models["target"], models["draft"])["llama-server+draft"]
    with LlamaServer("draft", target=files.target, draft=files.draft, n_ctx=128) as server:
        tokens, _, timing = server.run(torch.tensor([1, 5, 6, 7, 5, 6]), 4)
    assert 1 <= len(tokens) <= 4 and all(0 <= t < 64 for t in tokens)
