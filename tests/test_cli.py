"""The CLI on tiny model directories: JSON output, streaming, and clear errors for bad input."""

from __future__ import annotations

import json

import pytest

from speculant import SpeculativeDecoder
from speculant.cli import main

from tiny import tiny_llama, tiny_model_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = tiny_model_dir(root / "target", seed=0)
    base = tiny_llama(0, scale=4.0)
    draft = tiny_model_dir(root / "draft", seed=1, base=base, noise=0.3)
    other = tiny_model_dir(root / "other", seed=2, vocab=80)
    return {"target": str(target), "draft": str(draft), "other": str(other)}


PROMPT = "w1 w2 w3 w4 w1 w2"


def run_json(capsys, *args):
    code = main(["generate", "--json", "--dtype", "float32", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_json_output_and_methods_agree(dirs, capsys):
    outs = {}
    for method, extra in [("ar", []), ("sd", ["--gamma", "3"]), ("mcsd", ["--tree", "2x2x1"]),
                          ("mcsd", ["--tree", "3x2", "--no-replacement"]), ("lookup", [])]:
        d = run_json(capsys, "--target", dirs["target"], "--draft", dirs["draft"], "--method", method,
                     "--max-new-tokens", "12", *extra, PROMPT)
        assert set(d) >= {"text", "token_ids", "prompt_tokens", "stats"}
        assert set(d["stats"]) >= {"target_calls", "tokens_per_call", "acceptance_rate", "acceptance_by_depth",
                                   "accepted_per_call", "draft_s", "verify_s", "other_s", "wall_s", "tokens_per_s"}
        assert d["prompt_tokens"] == 6  # one token per word (no BOS: the tokenizer adds none)
        outs[(method, tuple(extra))] = d["token_ids"]
    assert len(set(map(tuple, outs.values()))) == 1  # every method: the same greedy output


def test_stop_strings_cut_the_output(dirs, capsys):
    full = run_json(capsys, "--target", dirs["target"], "--method", "ar", "--max-new-tokens", "12", PROMPT)
    stop = " ".join(full["text"].split(" ")[2:4])
    for method in ("ar", "lookup"):
        cut = run_json(capsys, "--target", dirs["target"], "--method", method, "--max-new-tokens", "12",
                       "--stop", "never", "--stop", stop, PROMPT)
        assert cut["text"] == full["text"][:full["text"].find(stop)] and cut["finish_reason"] == "stop"
    code = main(["generate", "--target", dirs["target"], *["--stop", "x"] * 5, PROMPT])
    assert code == 2 and "at most 4 stop strings" in capsys.readouterr().err


def test_sampling_is_reproducible_with_seed(dirs, capsys):
    args = ["--target", dirs["target"], "--draft", dirs["draft"], "--method", "sd", "--temperature", "0.8",
            "--top-p", "0.9", "--top-k", "20", "--seed", "7", "--max-new-tokens", "16", PROMPT]
    assert run_json(capsys, *args)["token_ids"] == run_json(capsys, *args)["token_ids"]


def test_stream_labels_tokens(dirs, capsys):
    dec = SpeculativeDecoder(dirs["target"], dirs["target"], method="sd", gamma=3, dtype="float32")
    events = list(dec.stream(PROMPT, 12))
    assert len(events) == 12
    assert {e.source for e in events} == {"draft", "target"}  # a self-draft accepts drafts
    assert "".join(e.text for e in events).strip() == dec.generate(PROMPT, 12).text.strip()
    code = main(["generate", "--dtype", "float32", "--target", dirs["target"], "--max-new-tokens", "5",
                 "--method", "lookup", PROMPT])
    assert code == 0 and "target calls" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--method", "ar", ""], "prompt is empty"),
    (["--method", "ar", "--max-new-tokens", "0", PROMPT], "max-new-tokens"),
    (["--method", "ar", "--temperature", "-1", PROMPT], "temperature"),
    (["--method", "ar", "--top-p", "0", PROMPT], "top_p"),
    (["--method", "ar", "--top-p", "1.5", PROMPT], "top_p"),
    (["--method", "mcsd", "--draft", "DRAFT", "--tree", "4x2x", PROMPT], "malformed tree spec"),
    (["--method", "sd", PROMPT], "needs a draft model"),
    (["--method", "sd", "--draft", "OTHER", PROMPT], "different vocabularies"),
    (["--method", "sd", "--draft", "/nonexistent/model.gguf", PROMPT], "no such model"),
    (["--method", "ar", " ".join(["w5"] * 600)], "context"),
])
def test_bad_input_is_a_clear_error(dirs, capsys, args, message):
    args = [a.replace("DRAFT", dirs["draft"]).replace("OTHER", dirs["other"]) for a in args]
    code = main(["generate", "--dtype", "float32", "--target", dirs["target"], *args])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.strip().splitlines()[-1].startswith("speculant: error:")


def test_corrupt_model_file(tmp_path, capsys):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    assert main(["generate", "--target", str(bad), "--method", "ar", PROMPT]) == 2
    assert "GGUF" in capsys.readouterr().err


def test_unknown_method_is_rejected_by_argparse(dirs, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--target", dirs["target"], "--method", "nope", PROMPT])
    assert e.value.code == 2


def test_train_heads_build_tree_and_medusa_generate(dirs, capsys, tmp_path):
    heads = tmp_path / "heads"
    assert main(["train-heads", "--target", dirs["target"], "--out", str(heads), "--n-stdlib", "4", "--n-wmt", "2",
                 "--max-new-tokens", "12", "--steps", "3", "--num-heads", "2", "--seq-len", "32", "--batch-size", "2",
                 "--grad-accum", "1", "--held-out", "0.34", "--dtype", "float32"]) == 0
    assert (heads / "config.json").is_file() and (heads / "model.safetensors").is_file()
    tree = tmp_path / "tree.json"
    assert main(["build-tree", "--target", dirs["target"], "--heads", str(heads), "--budget", "4",
                 "--out", str(tree), "--dtype", "float32"]) == 0
    capsys.readouterr()
    plain = run_json(capsys, "--target", dirs["target"], "--method", "ar", "--max-new-tokens", "16", PROMPT)
    for method, extra in [("medusa", ["--tree-file", str(tree)]), ("bpd", ["--gamma", "2"])]:
        out = run_json(capsys, "--target", dirs["target"], "--method", method, "--heads", str(heads),
                       "--max-new-tokens", "16", *extra, PROMPT)
        assert out["token_ids"] == plain["token_ids"]
        assert out["stats"]["acceptance"] == "exact" and out["stats"]["lossless"]
    # typical acceptance at temperature 0 is greedy; the stats say an approximate rule ran
    out = run_json(capsys, "--target", dirs["target"], "--method", "medusa", "--heads", str(heads), "--accept",
                   "typical", "--max-new-tokens", "16", PROMPT)
    assert out["token_ids"] == plain["token_ids"]
    assert out["stats"]["acceptance"] == "typical(0.09,0.3)" and not out["stats"]["lossless"]
    assert main(["generate", "--dtype", "float32", "--target", dirs["target"], "--method", "bpd", "--heads",
                 str(heads), "--accept", "topk=zero", PROMPT]) == 2
    assert "cannot read acceptance rule" in capsys.readouterr().err
    assert main(["generate", "--dtype", "float32", "--target", dirs["target"], "--method", "medusa", PROMPT]) == 2
    assert "needs medusa heads" in capsys.readouterr().err
    # sequential heads: trained by the same command on the same data, decoded with --method hydra
    seq = tmp_path / "seq"
    assert main(["train-heads", "--target", dirs["target"], "--out", str(seq), "--data", str(heads / "distill.jsonl"),
                 "--skip-distill", "--head-kind", "sequential", "--steps", "3", "--num-heads", "2",
                 "--held-out", "0.34", "--dtype", "float32"]) == 0
    capsys.readouterr()
    for extra in [[], ["--lookup-branch", "2"]]:
        out = run_json(capsys, "--target", dirs["target"], "--method", "hydra", "--heads", str(seq), "--tree", "2x1",
                       "--max-new-tokens", "16", *extra, PROMPT)
        assert out["token_ids"] == plain["token_ids"]
    assert main(["generate", "--dtype", "float32", "--target", dirs["target"], "--method", "medusa", "--heads",
                 str(seq), PROMPT]) == 2
    assert "use --method hydra" in capsys.readouterr().err


def test_demo_methods_are_checked_before_any_model_loads():
    from speculant.bench.demo import parse_methods
    from speculant.errors import ConfigError

    assert parse_methods("mcsd, hydra+lookup") == ("mcsd", "hydra+lookup")
    for bad in ("", "mcsd,bogus", "ar"):
        with pytest.raises(ConfigError, match="demo methods must be"):
            parse_methods(bad)
