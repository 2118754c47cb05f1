"""The CLI on tiny model directories: JSON output, streaming, and clear errors for bad input."""

from __future__ import annotations

import json

import pytest

from speculant import SpeculativeDecoder
from speculant.cli.commands import main

from tiny import lora_adapter, tiny_llama, tiny_model_dir, tiny_qwen2


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


@pytest.fixture(scope="module")
def bad(dirs, tmp_path_factory):
    """Inputs to get wrong: heads for the target and for another vocabulary, a corrupt heads
    checkpoint, a model whose weights are NaN, a file that only starts like a GGUF."""
    import shutil

    import torch

    from speculant.heads import HeadsConfig, MedusaHeads, save_heads
    from tiny import word_tokenizer

    root = tmp_path_factory.mktemp("bad")
    lm = SpeculativeDecoder(dirs["target"], method="ar", dtype="float32").target.model
    save_heads(MedusaHeads(HeadsConfig(3, 1, lm.config.hidden_size, 64), lm.get_output_embeddings()), root / "heads")
    other = SpeculativeDecoder(dirs["other"], method="ar", dtype="float32").target.model
    save_heads(MedusaHeads(HeadsConfig(3, 1, other.config.hidden_size, 80), other.get_output_embeddings()),
               root / "heads80")
    shutil.copytree(root / "heads", root / "corrupt")
    weights = root / "corrupt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    nan = tiny_llama(0)
    with torch.no_grad():
        nan.model.layers[0].mlp.down_proj.weight.fill_(float("nan"))
    nan.save_pretrained(root / "nan")
    word_tokenizer(64).save_pretrained(root / "nan")
    (root / "fake.gguf").write_bytes(b"GGUF" + bytes(60))
    # LoRA adapters made for other models: wider (hidden 64), deeper (3 layers), a Qwen2 of the same shapes
    for name, model in [("wide", tiny_llama(0, hidden=64)), ("deep", tiny_llama(0, layers=3)),
                        ("qwen", tiny_qwen2(0, hidden=48))]:
        model.save_pretrained(root / f"model-{name}")
        lora_adapter(root / f"model-{name}", root / f"lora-{name}")
    return {**dirs, "heads": str(root / "heads"), "heads80": str(root / "heads80"), "corrupt": str(root / "corrupt"),
            "nan": str(root / "nan"), "fake": str(root / "fake.gguf"), "root": str(root),
            **{f"lora-{n}": str(root / f"lora-{n}") for n in ("wide", "deep", "qwen")}}


# Bad input, each: exit status 2, one "speculant: error:" line that names the problem, no traceback.
# (generate's arguments after --dtype float32 --target TARGET unless the row names its own --target;
# placeholders: DRAFT, OTHER, HEADS, HEADS80, CORRUPT, NAN, FAKE, ROOT, LORA_WIDE, LORA_DEEP, LORA_QWEN)
BAD_INPUT = [
    ("empty prompt", ["--method", "ar", ""], "prompt is empty"),
    ("no new tokens", ["--method", "ar", "--max-new-tokens", "0", PROMPT], "max-new-tokens"),
    ("negative new tokens", ["--method", "ar", "--max-new-tokens", "-5", PROMPT], "max-new-tokens"),
    ("negative temperature", ["--method", "ar", "--temperature", "-1", PROMPT], "temperature"),
    ("NaN temperature", ["--method", "ar", "--temperature", "nan", PROMPT], "temperature"),
    ("top-p 0", ["--method", "ar", "--top-p", "0", PROMPT], "top_p"),
    ("top-p above 1", ["--method", "ar", "--top-p", "1.5", PROMPT], "top_p"),
    ("negative top-k", ["--method", "ar", "--top-k", "-1", PROMPT], "top_k must be >= 0"),
    ("malformed k-config", ["--method", "mcsd", "--draft", "DRAFT", "--tree", "4x2x", PROMPT], "malformed tree spec"),
    ("k-config with a zero", ["--method", "mcsd", "--draft", "DRAFT", "--tree", "2x0x1", PROMPT], "must be >= 1"),
    ("gamma 0", ["--method", "sd", "--draft", "DRAFT", "--gamma", "0", PROMPT], "between 1 and 64"),
    ("gamma 100", ["--method", "sd", "--draft", "DRAFT", "--gamma", "100", PROMPT], "between 1 and 64"),
    ("sd without a draft", ["--method", "sd", PROMPT], "needs a draft model"),
    ("draft of another vocabulary", ["--method", "sd", "--draft", "OTHER", PROMPT], "different vocabularies"),
    ("missing model file", ["--method", "sd", "--draft", "/nonexistent/model.gguf", PROMPT], "no such model"),
    ("unknown preset, close match", ["--target", "qwen2.5-coder-1.5b-instrct", "--method", "ar", PROMPT],
     "did you mean 'qwen2.5-coder-1.5b-instruct'"),
    ("prompt beyond the context", ["--method", "ar", " ".join(["w5"] * 600)], "context"),
    ("tree deeper than the heads", ["--method", "medusa", "--heads", "HEADS", "--tree", "2x1x1x1x1", PROMPT],
     "only 3 heads"),
    ("heads of another vocabulary", ["--method", "medusa", "--heads", "HEADS80", PROMPT], "trained for another model"),
    ("corrupt heads checkpoint", ["--method", "medusa", "--heads", "CORRUPT", PROMPT], "is corrupt"),
    ("missing heads", ["--method", "medusa", "--heads", "ROOT/none", PROMPT], "no heads checkpoint"),
    ("negative lookup branch", ["--method", "medusa", "--heads", "HEADS", "--lookup-branch", "-1", PROMPT],
     "lookup_branch=-1"),
    ("unknown acceptance rule", ["--method", "ar", "--accept", "foo", PROMPT], "cannot read acceptance rule"),
    ("typical eps >= 1", ["--method", "ar", "--accept", "typical=1.5", PROMPT], "in (0, 1)"),
    ("missing tree file", ["--method", "mcsd", "--draft", "DRAFT", "--tree-file", "ROOT/none.json", PROMPT],
     "cannot read --tree-file"),
    ("NaN logits from a broken model", ["--target", "NAN", "--method", "ar", PROMPT], "non-finite logits"),
    ("more than 4 stop strings", ["--method", "ar", *["--stop", "x"] * 5, PROMPT], "at most 4 stop strings"),
    ("unwritable cache directory", ["--target", "FAKE", "--method", "ar", PROMPT], "cannot write the model cache"),
    ("non-UTF-8 prompt on stdin", ["--method", "ar", "-"], "not UTF-8 text"),
    ("LoRA directory without an adapter", ["--method", "ar", "--lora", "ROOT", PROMPT], "no peft adapter"),
    ("missing LoRA directory", ["--method", "ar", "--lora", "ROOT/none", PROMPT], "no such directory"),
    ("LoRA for another hidden size", ["--method", "ar", "--lora", "LORA_WIDE", PROMPT], "does not fit the target"),
    ("LoRA for layers the target lacks", ["--method", "ar", "--lora", "LORA_DEEP", PROMPT],
     "adapts model.layers.2."),
    ("LoRA for another architecture", ["--method", "ar", "--lora", "LORA_QWEN", PROMPT],
     "made for a Qwen2ForCausalLM"),
]


@pytest.mark.parametrize("what, args, message", BAD_INPUT, ids=[row[0] for row in BAD_INPUT])
def test_bad_input_is_a_clear_error(bad, capsys, monkeypatch, what, args, message):
    import io
    import sys

    names = {"DRAFT": "draft", "OTHER": "other", "HEADS80": "heads80", "HEADS": "heads", "CORRUPT": "corrupt",
             "NAN": "nan", "FAKE": "fake", "ROOT": "root", "LORA_WIDE": "lora-wide", "LORA_DEEP": "lora-deep",
             "LORA_QWEN": "lora-qwen"}
    for key, name in names.items():
        args = [a.replace(key, bad[name]) for a in args]
    if what == "unwritable cache directory":
        monkeypatch.setenv("SPECULANT_CACHE", "/proc/speculant-cache")  # no directory can be made there
    if what == "non-UTF-8 prompt on stdin":
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 \xff")))
    target = [] if "--target" in args else ["--target", bad["target"]]
    code = main(["generate", "--dtype", "float32", *target, *args])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert message in err and lines[-1].startswith("speculant: error:") and "Traceback" not in err
    assert len(BAD_INPUT) >= 25


def test_api_bad_input_and_nothing_half_written(bad, tmp_path, monkeypatch, capsys):
    """The Python API raises the same errors (SpeculantError subclasses): a batch limit of 0, heads
    for another hidden size, and a disk that fills while heads are saved, which leaves no file
    behind; a draft larger than the target is a warning, not an error."""
    import errno

    from speculant.errors import ConfigError, ModelLoadError
    from speculant.heads import HeadsConfig, MedusaHeads, load_heads, save_heads

    dec = SpeculativeDecoder(bad["target"], method="ar", dtype="float32")
    with pytest.raises(ConfigError, match="max_batch must be >= 1"):
        dec.generate_batch([PROMPT], 4, max_batch=0)
    lm = dec.target.model
    with pytest.raises(ModelLoadError, match="hidden states of size"):  # heads given as a module
        SpeculativeDecoder(bad["target"], method="medusa", dtype="float32", heads=MedusaHeads(
            HeadsConfig(3, 1, lm.config.hidden_size * 2, 64), torch_linear(lm.config.hidden_size * 2, 64)))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr("safetensors.torch.save_file", full)
    out = tmp_path / "heads"
    with pytest.raises(ConfigError, match="No space left on device"):
        save_heads(load_heads(bad["heads"], lm), out)
    assert list(out.iterdir()) == []  # nothing half-written
    monkeypatch.undo()
    capsys.readouterr()
    big = tmp_path / "big"
    bigger = tiny_llama(0, hidden=96, layers=3)
    bigger.save_pretrained(big)
    from tiny import word_tokenizer
    word_tokenizer(64).save_pretrained(big)
    SpeculativeDecoder(bad["target"], str(big), method="sd", dtype="float32")
    assert "warning: the draft model" in capsys.readouterr().err


def torch_linear(h: int, v: int):
    import torch
    return torch.nn.Linear(h, v, bias=False)


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


@pytest.mark.parametrize("json_out", [True, False], ids=["json", "stream"])
def test_ctrl_c_during_generate_prints_what_was_generated_and_exits_130(dirs, capsys, monkeypatch, json_out):
    from speculant.api import SpeculativeDecoder as Dec

    full = SpeculativeDecoder(dirs["target"], method="ar", dtype="float32").generate(PROMPT, 12)
    run = Dec.steps

    def interrupted(self, *a, **k):  # Ctrl-C arrives after the third step
        for i, item in enumerate(run(self, *a, **k)):
            if i == 3:
                raise KeyboardInterrupt
            yield item
    monkeypatch.setattr(Dec, "steps", interrupted)
    args = ["generate", "--dtype", "float32", "--target", dirs["target"], "--method", "ar", "--max-new-tokens", "12"]
    code = main(args + (["--json"] if json_out else []) + [PROMPT])
    out, err = capsys.readouterr()
    assert code == 130
    if json_out:
        d = json.loads(out)
        assert d["finish_reason"] == "cancelled" and d["token_ids"] == full.token_ids[:3]
        assert d["text"] == full.text[:len(d["text"])] and d["text"]
    else:
        assert "interrupted after 3 generated tokens" in err
        assert out.strip() and full.text.startswith(out.strip())
