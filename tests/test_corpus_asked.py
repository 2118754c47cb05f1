"""The self-instructed prose families (speculant.training.asked): requests parsed from the target's
own lists, summaries and documents from its own prose, German→English from its own German; grown
deterministically from the records, none a Spec-Bench question, and made by ``make-corpus
--families asked``."""

from __future__ import annotations

import json

import pytest

from speculant.training.asked import ASK, SUBJECTS, SUMMARIZE, asked_families, grow_asked, listed_requests, prose_answers
from speculant.training.corpus import MANIFEST_NAME, make_corpus

from tiny import tiny_model_dir


class Tok:  # ids are the characters' code points
    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def rec(prompt: str, answer: str) -> dict:
    return {"prompt": prompt, "ids": [0] + [ord(c) for c in answer], "prompt_len": 1}


def prose(n: int, word: str) -> str:
    return " ".join([word] * n) + "."


def test_numbered_items_become_requests():
    text = ("Here are some:\n1. What is the **best** way to start a garden?\n2) How do plants grow in winter time\n"
            "3. Too short\n- Why is a bullet point not taken here at all?\n10. \"Why do cats purr when happy?\"\n"
            "No. 4 is not an item either")
    assert listed_requests(text) == ["What is the best way to start a garden?", "How do plants grow in winter time",
                                     "Why do cats purr when happy?"]


def test_families_start_with_every_kind_per_subject_and_no_spec_bench_text():
    from speculant.training.data import _norm, _spec_bench_text

    families = asked_families()
    ask = families["ask"]
    assert len(ask) == len(SUBJECTS) * (len(ASK) + 1) and len(set(ask)) == len(ask)
    assert all(SUBJECTS[0] in p for p in ask[:len(ASK) + 1])  # every kind of the first subject first
    assert {k: v for k, v in families.items() if k != "ask"} == {"asked": [], "summarize": [], "rag": [], "de-en": []}
    spec = _spec_bench_text()
    assert not any(_norm(p) in spec for p in ask)


def test_grown_families_come_from_the_records_in_file_order():
    families = asked_families(["bees", "tides"])
    lists, german = families["ask"][0], families["ask"][len(ASK)]
    assert german.startswith("Schreibe") and "bees" in german
    q = ["Why do bees dance in front of the hive?", "How do bees make honey from nectar?",
         "What do bees do in the winter months?", "Which flowers do bees like the most?"]
    answers = [prose(150, "alpha"), prose(130, "beta"), "```python\nprint(1)\n```" + prose(150, "code"),
               prose(160, "gamma")]
    records = [rec(lists, "Sure:\n" + "\n".join(f"{i + 1}. {x}" for i, x in enumerate(q))),
               rec(german, "Die Bienen sind für die Natur sehr wichtig. Sie leben in einem Stock."),
               *[rec(x, a) for x, a in zip(q, answers)],
               rec("Not asked for: tell me more about bees and their life.", prose(150, "delta"))]
    grow_asked(families, records, Tok())
    assert families["asked"] == q
    assert families["de-en"] == ["Translate German to English: Die Bienen sind für die Natur sehr wichtig."]
    kept = prose_answers(records, Tok(), set(q))  # no code block, 120-400 words, asked prompts only
    assert [p for p, _ in kept] == [q[0], q[1], q[3]]
    assert len(families["summarize"]) == 3 and answers[0] in families["summarize"][0]
    assert [s.split("\n\n")[0] for s in families["summarize"]] == [t.split("\n\n")[0] for t in SUMMARIZE]
    (rag,) = families["rag"]  # one question answered from its own answer and the two before it
    assert q[3][1:] in rag and all(a in rag for a in (answers[0], answers[1], answers[3]))
    assert "Document 3:" in rag and "delta" not in rag
    again = asked_families(["bees", "tides"])
    grow_asked(again, records, Tok())
    assert again == families  # deterministic


def test_make_corpus_answers_the_asked_set_and_names_its_sources(tmp_path):
    import speculant

    model_dir = tiny_model_dir(tmp_path / "tiny", seed=0, vocab=64)
    dec = speculant.SpeculativeDecoder(str(model_dir), method="ar", chat=True, dtype="float32", backend="native")
    manifest = make_corpus(dec, tmp_path / "c", 40, batch_size=2, max_new_tokens=4, progress=False,
                           families="asked")
    assert manifest["answer_tokens"] >= 40 and set(manifest["by_family"]) == {"ask"}  # a tiny model lists nothing
    assert set(json.loads((tmp_path / "c" / MANIFEST_NAME).read_text())["sources"]) >= {"ask", "asked", "rag"}
    with pytest.raises(ValueError, match="unknown family set 'prose'"):
        make_corpus(dec, tmp_path / "d", 40, families="prose")
    assert not (tmp_path / "d").exists()
