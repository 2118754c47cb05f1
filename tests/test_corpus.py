"""The drafter's training corpus (speculant.training.corpus): every family present, none from
Spec-Bench, interleaved so that any prefix is balanced, made up to a token goal with speculant's
batched engine, resumable, with a manifest that counts it."""

from __future__ import annotations

import json

import pytest

from speculant.training.corpus import CORPUS_NAME, MANIFEST_NAME, code_edit_prompts, corpus_families, interleave, \
    make_corpus
from speculant.training.data import load_records

from tiny import tiny_model_dir

V = 64


def test_families_are_large_and_not_the_evaluation_set():
    from speculant.training.data import _norm, _spec_bench_text

    families = corpus_families(["Guten Morgen.", " "])
    assert families["de-en"] == ["Translate German to English: Guten Morgen."]
    sizes = {k: len(v) for k, v in families.items()}
    assert all(n >= 300 for k, n in sizes.items() if k != "de-en"), sizes
    assert sum(sizes.values()) > 5000  # with ~200-token answers: over a million tokens
    spec = _spec_bench_text()
    for name, prompts in families.items():
        assert not any(len(_norm(p)) > 40 and _norm(p) in spec for p in prompts), name
    edits = code_edit_prompts(["json"])
    assert edits and all("```python\ndef " in p for p in edits)
    order = interleave({"a": ["1", "2", "3"], "b": ["4"], "c": ["1", "5"]}, 2)
    assert order == [("a", "1"), ("a", "2"), ("b", "4"), ("c", "5"), ("a", "3")]  # duplicates dropped


def test_german_prose_gives_stand_alone_sentences_in_file_order():
    from speculant.training.corpus import german_sources
    from speculant.training.prompts import german_sentences, german_writing_prompts

    prose = ("Hier ist ein kurzer Absatz:\n\nDas Lernen einer Sprache ist für viele Menschen nicht leicht. "
             "Man braucht viel Geduld und auch Zeit! Es lohnt sich.\n- Ein Punkt in einer Liste ist das hier.\n"
             "Liebe Anna,\nThis English sentence has the word die in it.\n# Eine Überschrift ist das hier nicht.")
    assert german_sentences(prose) == ["Das Lernen einer Sprache ist für viele Menschen nicht leicht.",
                                       "Man braucht viel Geduld und auch Zeit!"]

    class Tok:  # ids are the characters' code points
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    write = german_writing_prompts()[0]
    recs = [{"prompt": p, "ids": [0] + [ord(c) for c in a], "prompt_len": 1} for p, a in [
        ("Translate the input English sentence into German.\nInput: Good day.\nOutput: ", "Guten Tag."),
        ("Explain gravity.", "Die Schwerkraft ist eine Kraft, die wir nicht sehen."),  # German, but not asked for
        (write, prose),
        ("Translate the input English sentence into German.\nInput: Two.\nOutput: ", "Zwei\nZeilen"),
    ]]
    assert german_sources(recs, Tok(), {write}) == ["Guten Tag.", "Das Lernen einer Sprache ist für viele Menschen "
                                                    "nicht leicht.", "Man braucht viel Geduld und auch Zeit!"]


def test_corpus_reaches_its_goal_resumes_and_counts(tmp_path):
    import speculant

    model_dir = tiny_model_dir(tmp_path / "tiny", seed=0, vocab=V)
    dec = speculant.SpeculativeDecoder(str(model_dir), method="ar", chat=True, dtype="float32", backend="native")
    out = tmp_path / "corpus"
    first = make_corpus(dec, out, 150, batch_size=4, max_new_tokens=6, progress=False, describe={"command": "test"})
    recs = load_records(out / CORPUS_NAME)
    assert first["answer_tokens"] >= 150 and first["records"] == len(recs) and first["command"] == "test"
    assert first["answer_tokens"] - 4 * 4 * 6 < 150  # stops at the first group (4 batches) past the goal
    assert {"chat", "code", "code-edit", "en-de", "docs", "math", "de-write"} <= set(first["by_family"])
    assert sum(f["answer_tokens"] for f in first["by_family"].values()) == first["answer_tokens"]
    assert json.loads((out / MANIFEST_NAME).read_text())["records"] == len(recs)
    more = make_corpus(dec, out, 300, batch_size=4, max_new_tokens=6, progress=False)
    again = load_records(out / CORPUS_NAME)
    assert again[:len(recs)] == recs  # resumed: nothing made twice
    assert more["answer_tokens"] >= 300 and "de-en" in more["by_family"]  # German of its own en-de answers
    assert more["started"] == first["started"] and more["seconds"] >= first["seconds"]
    assert len(more["runs"]) == 2 and more["runs"][0] == first["runs"][0] and more["runs"][1]["machine"]["cores"] >= 1
    assert [r["records"] for r in more["runs"]] == [len(recs), len(again) - len(recs)]  # what each run added
    assert sum(r["answer_tokens"] for r in more["runs"]) == more["answer_tokens"]
    assert more["seconds"] == round(sum(r["seconds"] for r in more["runs"]), 1)
    # CPU-hours from the runs' own CPU time; a run recorded with wall seconds only counts them on every core
    assert all(r["cpu_seconds"] > 0 for r in more["runs"])
    assert more["cpu_hours"] == round(sum(r["cpu_seconds"] for r in more["runs"]) / 3600, 3)
    old = {k: v for k, v in more["runs"][0].items() if k != "cpu_seconds"}
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["runs"][0] = old
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    mixed = make_corpus(dec, out, 300, batch_size=4, max_new_tokens=6, progress=False)
    assert len(mixed["runs"]) == 2  # the goal was reached: this run answered nothing and is not one
    assert mixed["cpu_hours"] == round((old["seconds"] * old["machine"]["cores"] + mixed["runs"][1]["cpu_seconds"])
                                       / 3600, 3)
    assert mixed["records"] == len(again)
    assert more["prompts_left"] > 0


def test_corpus_says_when_its_prompts_run_out(tmp_path, monkeypatch, capsys):
    """A goal beyond what the families' prompts give: every prompt answered once, then the CLI
    says the goal was not reached (and why) instead of stopping silently short."""
    import speculant.training.corpus as corpus
    from speculant.cli.commands import main

    monkeypatch.setattr(corpus, "corpus_families", lambda german, seed=0: {"chat": ["Say hi.", "Name a colour."]})
    model_dir = tiny_model_dir(tmp_path / "tiny", seed=0, vocab=V)
    assert main(["make-corpus", "--target", str(model_dir), "--out", str(tmp_path / "c"), "--tokens", "100000",
                 "--batch", "2", "--max-new-tokens", "4", "--method", "ar"]) == 0
    manifest = json.loads((tmp_path / "c" / MANIFEST_NAME).read_text())
    assert manifest["records"] == 2 and manifest["prompts_left"] == 0
    assert "every prompt of the corpus's families is answered" in capsys.readouterr().err


def test_cli_refuses_a_goal_of_nothing(tmp_path, capsys):
    from speculant.cli.commands import main

    assert main(["make-corpus", "--out", str(tmp_path / "c"), "--tokens", "0"]) == 2
    assert "--tokens must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_corpus_to_drafter_to_decoding_from_the_command_line(tmp_path, capsys):
    """make-corpus, then train-eagle on it, then generate --method eagle with the drafter: the
    same text as plain decoding."""
    from speculant.cli.commands import main

    target = str(tiny_model_dir(tmp_path / "tiny", seed=0, vocab=V))
    corpus, drafter = tmp_path / "corpus", tmp_path / "eagle"
    assert main(["make-corpus", "--target", target, "--out", str(corpus), "--tokens", "300", "--batch", "4",
                 "--max-new-tokens", "12", "--method", "ar"]) == 0
    assert main(["train-eagle", "--target", target, "--data", str(corpus / "corpus.jsonl"), "--out", str(drafter),
                 "--steps", "20", "--batch-size", "2", "--seq-len", "32", "--depth", "3", "--intermediate-size", "64",
                 "--draft-vocab", "40", "--held-out", "2"]) == 0
    report = json.loads((drafter / "training_report.json").read_text())
    assert report["steps"] == 20 and len(report["depth_accuracy"]) == 5
    assert report["features"]["shards"] == 1 and report["features"]["cpu_seconds"] > 0  # what the features took
    capsys.readouterr()
    # float32: this tiny model runs on transformers (its widths do not fit the int4 layout), where bf16 tree
    # passes are not row-invariant and a near-tie could flip with the tree's shape, which is timed per step
    args = ["generate", "--target", target, "--dtype", "float32", "--max-new-tokens", "16", "--json", "w1 w2 w3 w1 w2"]
    assert main(args + ["--method", "ar"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--method", "eagle", "--heads", str(drafter)]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
    # a narrower drafter fine-tuned from this one: its shape and draft vocabulary, a narrower MLP
    narrow = tmp_path / "narrow"
    assert main(["train-eagle", "--target", target, "--data", str(corpus / "corpus.jsonl"), "--out", str(narrow),
                 "--init", str(drafter), "--intermediate-size", "24", "--steps", "5", "--batch-size", "2",
                 "--seq-len", "32", "--held-out", "2"]) == 0
    config = json.loads((narrow / "config.json").read_text())["speculant_eagle"]
    assert (config["intermediate_size"], config["draft_vocab"], config["depth"]) == (24, 40, 3)
    capsys.readouterr()
    assert main(args + ["--method", "eagle", "--heads", str(narrow)]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
    assert main(["train-eagle", "--target", target, "--data", str(corpus / "corpus.jsonl"), "--out",
                 str(tmp_path / "wide"), "--init", str(drafter), "--intermediate-size", "128", "--steps", "5"]) == 2
    assert "narrowed to 1 .. 64 units" in capsys.readouterr().err and not (tmp_path / "wide").exists()
    assert main(["train-eagle", "--target", target, "--data", str(corpus / "corpus.jsonl"), "--out",
                 str(tmp_path / "none"), "--init", str(corpus), "--steps", "5"]) == 2
    assert "no EAGLE drafter there" in capsys.readouterr().err and not (tmp_path / "none").exists()
    # EAGLE-3's fusion on top of it: it reads the state entering layer 1 too, and still decodes as plain
    fused = tmp_path / "fused"
    assert main(["train-eagle", "--target", target, "--data", str(corpus / "corpus.jsonl"), "--out", str(fused),
                 "--init", str(drafter), "--fuse-layers", "1", "--steps", "5", "--batch-size", "2",
                 "--seq-len", "32", "--held-out", "2"]) == 0
    config = json.loads((fused / "config.json").read_text())["speculant_eagle"]
    assert config["fused_layers"] == [1] and config["draft_vocab"] == 40
    capsys.readouterr()
    assert main(args + ["--method", "eagle", "--heads", str(fused)]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
    # the drafter without fusion and the fused one measured side by side on the same positions
    assert main(["drafter-accuracy", "--target", target, "--data", str(corpus / "corpus.jsonl"), "--eagle",
                 str(drafter), str(fused), "--held-out", "2", "--per-record", "4", "--depth", "2"]) == 0
    both = json.loads(capsys.readouterr().out)["drafters"]
    assert [e["path"] for e in both] == ["eagle", "fused"] and all(len(e["greedy"]) == 2 for e in both)
    # the accuracy file `make drafter` ships beside the drafter, which auto's forecast reads
    _drafter_accuracy(target, corpus / "corpus.jsonl", drafter, tmp_path, capsys)


def _drafter_accuracy(target: str, data, drafter, tmp_path, capsys) -> None:
    """speculant drafter-accuracy on a corpus, its features and drafter, beside sequential heads:
    both kinds measured on the same positions, each with a tree table the forecast can read."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from speculant.tuning.choice import held_out_accepts
    from speculant.heads import HeadsConfig, SequentialHeads, save_heads

    hf = AutoModelForCausalLM.from_pretrained(target)
    H = hf.config.hidden_size
    heads = SequentialHeads(HeadsConfig(2, 1, H, V, kind="sequential"), hf.get_output_embeddings(),
                            hf.get_input_embeddings())
    with torch.no_grad():
        for q in heads.parameters():
            q.mul_(0.0).add_(0.1)
    save_heads(heads.eval(), tmp_path / "heads")

    from speculant.cli.commands import main

    argv = ["drafter-accuracy", "--target", target, "--data", str(data), "--hydra", str(tmp_path / "heads"),
            "--eagle", str(drafter), "--held-out", "2", "--per-record", "4", "--depth", "3"]

    def run(*extra: str) -> dict:
        capsys.readouterr()
        assert main(argv + list(extra)) == 0
        return json.loads(capsys.readouterr().out)

    out = run("--features", str(drafter / "features"))
    # without train-eagle's cache the target computes the measured records' features: the same figures
    assert run() == out
    kinds = {e["kind"]: e for e in out["drafters"]}
    assert set(kinds) == {"hydra", "eagle"} and len(kinds["eagle"]["greedy"]) == 3
    for e in kinds.values():
        assert len(e["tree"]) == {"hydra": 2, "eagle": 3}[e["kind"]] and len(e["tree"][0]) == 31
        assert e["tree"][0][0] == pytest.approx(e["greedy"][0])  # the best node: the root's top child
    # a text no drafter trained on: every record measured (the shipped file's Spec-Bench answers)
    from speculant.training.data import load_records
    every = run("--all-records")
    assert every["records"] == list(range(len(load_records(data)))) and len(every["records"]) > len(out["records"])
    assert every["data"] == Path(data).name and len(every["drafters"]) == 2
    (drafter / "accuracy.json").write_text(json.dumps(out))
    assert set(held_out_accepts(drafter)) == {"hydra", "eagle"}


def test_train_eagle_ranks_its_draft_vocabulary_on_the_records_it_trains_on(tmp_path):
    """A token that only the held-out records' answers hold (and hold most often) is left out of
    the draft vocabulary, so the held-out accuracy does not see its records through it."""
    import torch
    from safetensors.torch import load_file

    from speculant.cli.commands import main
    from speculant.training.eagle_train import split_records

    target = str(tiny_model_dir(tmp_path / "tiny", seed=0, vocab=V))
    held = split_records(10, 2)[0]
    records = [{"prompt": f"p{r}", "prompt_len": 4,
                "ids": [1, 2, 3, 4] + ([60] * 20 if r in held else [5 + (r + j) % 12 for j in range(20)])}
               for r in range(10)]
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "eagle"
    assert main(["train-eagle", "--target", target, "--data", str(data), "--out", str(out), "--steps", "1",
                 "--batch-size", "2", "--seq-len", "16", "--depth", "2", "--intermediate-size", "32",
                 "--draft-vocab", "12", "--held-out", "2"]) == 0
    vocab = load_file(str(out / "model.safetensors"))["draft_vocab"]
    assert torch.equal(vocab, torch.arange(5, 17))  # the 12 answer tokens of the training records


def test_train_eagle_init_takes_a_draft_vocabulary_ranked_on_other_data(tmp_path, capsys):
    """train-eagle --init --draft-vocab N ranks a new list of N tokens (here on --vocab-data, a
    corpus it does not train on) and keeps the drafter's weights; --data FILE@N trains on N records
    spread over FILE; a missing file, FILE@0 and a negative size are refused before any work."""
    import torch
    from safetensors.torch import load_file

    from speculant.cli.commands import main
    from speculant.cli.training import _corpus_records

    target = str(tiny_model_dir(tmp_path / "tiny", seed=0, vocab=V))
    records = [{"prompt": f"p{r}", "prompt_len": 4, "ids": [1, 2, 3, 4] + [5 + (r + j) % 12 for j in range(20)]}
               for r in range(10)]
    data, other = tmp_path / "corpus.jsonl", tmp_path / "other.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    other.write_text(json.dumps({"prompt": "q", "prompt_len": 1, "ids": [1] + [40 + j % 20 for j in range(60)]}) + "\n")
    assert [r["prompt"] for r in _corpus_records([f"{data}@3"])] == ["p1", "p5", "p8"]
    assert len(_corpus_records([f"{data}@99", str(other)])) == 11
    assert [r["prompt"] for r in _corpus_records([f"{data}@7:10"])] == ["p7", "p8", "p9"]  # a slice, in order
    first, tuned = tmp_path / "eagle", tmp_path / "tuned"
    common = ["--target", target, "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--held-out", "2"]
    assert main(["train-eagle", *common, "--data", str(data), "--out", str(first), "--depth", "2",
                 "--intermediate-size", "32", "--draft-vocab", "12"]) == 0
    assert main(["train-eagle", *common, "--data", f"{data}@6", "--out", str(tuned), "--init", str(first),
                 "--draft-vocab", "20", "--vocab-data", str(other), "--lr", "1e-12"]) == 0
    before, after = load_file(str(first / "model.safetensors")), load_file(str(tuned / "model.safetensors"))
    assert torch.equal(after["draft_vocab"], torch.arange(40, 60))  # other.jsonl's 20 answer tokens
    assert json.loads((tuned / "config.json").read_text())["speculant_eagle"]["draft_vocab"] == 20
    torch.testing.assert_close(after["fc.weight"], before["fc.weight"])  # lr ~0: the weights as they were
    assert json.loads((tuned / "training_report.json").read_text())["train_windows"] > 0
    for spec, said in ((str(tmp_path / "nope.jsonl"), "no file"), (f"{data}@0", "FILE@N takes N >= 1"),
                       (f"{data}@4:11", "START < END <= 10"), (f"{data}@5:5", "START < END")):
        assert main(["train-eagle", "--target", target, "--data", spec, "--out", str(tmp_path / "x")]) == 2
        assert said in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["train-eagle", "--target", target, "--data", str(data), "--out", str(tmp_path / "x"),
                 "--draft-vocab", "-1"]) == 2
    assert "--draft-vocab must be >= 0" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_a_packed_corpus_holds_no_prompt_and_makes_the_same_corpus_again(tmp_path, monkeypatch):
    """make-corpus --packed: the answers keyed by their prompt's SHA-256 (no prompt text in the
    file), and a fresh output directory made from them and the prompts, record for record, with
    nothing answered again; a packed file answered with another tokenizer is refused."""
    import gzip

    import speculant
    from speculant.errors import ConfigError
    from speculant.training import corpus as corpus_mod
    from speculant.training.corpus import PACKED_NAME
    from speculant.training.corpus_pack import read_packed, unpack

    model_dir = tiny_model_dir(tmp_path / "tiny", seed=0, vocab=V)
    dec = speculant.SpeculativeDecoder(str(model_dir), method="ar", chat=True, dtype="float32", backend="native")
    prompts = [f"private question number {i}: what is {i} plus {i}?" for i in range(12)]
    monkeypatch.setattr(corpus_mod, "_family_set", lambda name, seed: ({"private": prompts}, lambda *_: None,
                                                                       {"private": "not ours"}, {}))
    packed = tmp_path / "packed"
    first = make_corpus(dec, tmp_path / "a", 40, batch_size=2, max_new_tokens=5, progress=False, packed=packed)
    made = load_records(tmp_path / "a" / CORPUS_NAME)
    text = gzip.decompress((packed / PACKED_NAME).read_bytes()).decode()
    assert len(text.splitlines()) == len(made) == first["records"] and "private question" not in text
    assert json.loads((packed / MANIFEST_NAME).read_text()) == first

    def no_answers(*a, **k):
        raise AssertionError("a packed answer was made again")

    monkeypatch.setattr(corpus_mod, "distill", no_answers)
    kept = {name: (packed / name).read_bytes() for name in (PACKED_NAME, MANIFEST_NAME)}
    again = make_corpus(dec, tmp_path / "b", 40, batch_size=2, max_new_tokens=5, progress=False, packed=packed)
    assert load_records(tmp_path / "b" / CORPUS_NAME) == made
    assert again["answer_tokens"] == first["answer_tokens"] and again["runs"] == first["runs"]
    # a restore answers nothing: the committed files are left byte for byte as they were
    assert {name: (packed / name).read_bytes() for name in kept} == kept
    with pytest.raises(ConfigError, match="another tokenizer"):
        unpack(read_packed(packed / PACKED_NAME), prompts, lambda p: [1, 2, 3])
    (tmp_path / "junk.gz").write_bytes(b"not gzip")
    with pytest.raises(ConfigError, match="not a packed corpus"):
        read_packed(tmp_path / "junk.gz")


def test_a_record_holding_a_unicode_line_separator_is_kept(tmp_path):
    """JSON keeps U+2028 (and U+0085, form feeds) unescaped inside strings: the records are split at
    newlines only, so such an answer is neither dropped nor answered again on resume."""
    from speculant.training.data import rewrite_records

    recs = [{"prompt": "a\u2028b", "prompt_len": 1, "ids": [1, 2, 3]}, {"prompt": "c\x85d\x0ce", "prompt_len": 1,
                                                                       "ids": [4, 5]}]
    path = tmp_path / "corpus.jsonl"
    rewrite_records(path, recs)
    assert load_records(path) == recs
