"""Self-instructed prompt families: prose of the kinds users ask for, in the target's own words.

The drafter corpus's chat prompts come from short hand-written lists, and most of its tokens are
code and arithmetic; a drafter trained on it guesses the target's prose (writing, role play,
explanations, factual answers, summaries, answers from documents, German→English translation)
far less often than its code. This family set grows prose prompts from the target itself, in two
stages, as the German→English family already grows from the target's own German:

* ``ask``        asks the target for lists of requests on hand-written subjects (:data:`SUBJECTS`)
                 of five kinds (:data:`ASK`): questions, writing tasks, explanations, factual
                 questions, role play; and for short German paragraphs on the same subjects;
* ``asked``      the requests parsed from those lists (:func:`listed_requests`), in the order the
                 lists were answered;
* ``summarize``  summaries of the target's own prose answers to ``asked`` prompts;
* ``rag``        a question of ``asked`` answered from three numbered documents, one of them the
                 target's answer to it, two others answers;
* ``de-en``      German→English translation of the sentences of the target's German paragraphs.

Every prompt is deterministic given the records made so far, so a corpus made in several runs
holds the same records as one made in a single run. No prompt is a Spec-Bench question: the
subjects and templates are written here, and the rest is the target's own text.
"""

from __future__ import annotations

import re
from typing import Sequence

from .prompts import de_en_prompts, german_sentences

__all__ = ["ASK", "SUBJECTS", "asked_families", "grow_asked", "listed_requests", "prose_answers"]

SUBJECTS = (
    "cooking at home", "gardening", "personal finance", "travel in Europe", "travel in Asia", "pets",
    "physical fitness", "sleep", "nutrition", "mental health", "parenting", "job interviews",
    "starting a small business", "remote work", "public speaking", "learning languages", "music history",
    "painting and drawing", "photography", "film making", "classical literature", "poetry",
    "ancient Rome", "the Middle Ages", "the Industrial Revolution", "World War I", "the Cold War",
    "space exploration", "astronomy", "climate and weather", "oceans", "volcanoes and earthquakes",
    "human biology", "genetics", "infectious diseases", "chemistry in everyday life", "electricity",
    "renewable energy", "cars and driving", "trains and railways", "aviation", "architecture",
    "city planning", "economics", "the stock market", "philosophy", "ethics", "psychology",
    "sociology", "law and courts", "elections and government", "journalism", "social media",
    "video games", "board games", "sports", "the Olympic Games", "football", "fashion",
    "home repair", "volunteering", "friendship", "weddings", "holidays and festivals", "mythology",
    "religions of the world", "geography of Africa", "geography of South America", "wildlife",
    "insects", "birds", "the history of science", "famous inventors", "mathematics puzzles",
    "probability in daily life", "computers and the internet", "privacy and security online",
    "artificial intelligence", "education and schools", "universities", "museums", "theatre",
    "dance", "coffee and tea", "wine and beer", "baking bread", "recycling", "minimalism",
)
ASK = (
    "Write a numbered list of 8 different questions that curious people often ask about {s}. "
    "Write only the questions, one per line.",
    "Write a numbered list of 8 different writing tasks a person might give an assistant about {s} "
    "(for example an email, a blog post, a short story, a speech, a poem or a product description). "
    "Write only the tasks, one per line, each as a full instruction.",
    "Write a numbered list of 8 different requests asking someone to explain, compare or give advice "
    "about {s}. Write only the requests, one per line.",
    "Write a numbered list of 8 short factual questions about {s}, each with a single clear answer. "
    "Write only the questions, one per line.",
    "Write a numbered list of 8 role-play requests related to {s}: each asks the assistant to act as a "
    "specific character and to answer a question in that character's voice. Write only the requests, "
    "one per line.",
)
GERMAN_ASK = "Schreibe einen kurzen Absatz auf Deutsch (fünf bis sieben Sätze) über das Thema: {s}."
SUMMARIZE = (
    "Summarize the following text in three sentences.\n\n{text}",
    "Write a short summary of this article for a busy reader.\n\n{text}",
    "Give a one-paragraph summary of the main points below.\n\n{text}",
)
RAG = ("Answer the question using the documents below.\n\n{docs}\n\nQuestion: {q}",
       "{docs}\n\nBased on these documents, {q}")

_ITEM = re.compile(r"^\s*(\d{1,2})[.)]\s+(.*\S)\s*$")


def _answer(rec: dict, tokenizer) -> str:
    """The decoded answer of a corpus record."""
    return tokenizer.decode(rec["ids"][rec["prompt_len"]:], skip_special_tokens=True)


def listed_requests(text: str, min_words: int = 5, max_words: int = 60) -> list[str]:
    """The items of a numbered list in ``text`` (``1. ...`` or ``1) ...``, one per line), markdown
    emphasis and quotes removed, each of ``min_words`` to ``max_words`` words."""
    out = []
    for line in text.splitlines():
        m = _ITEM.match(line)
        if not m:
            continue
        item = re.sub(r"\*\*|__|`", "", m.group(2)).strip().strip('"').strip()
        if min_words <= len(item.split()) <= max_words:
            out.append(item)
    return out


def prose_answers(records: Sequence[dict], tokenizer, prompts: set[str], min_words: int = 120,
                  max_words: int = 400) -> list[tuple[str, str]]:
    """(prompt, answer text) of the records answering ``prompts`` whose answer is prose: no code
    block, ``min_words`` to ``max_words`` words; in file order."""
    out = []
    for rec in records:
        if rec["prompt"] not in prompts:
            continue
        text = _answer(rec, tokenizer).strip()
        if "```" not in text and min_words <= len(text.split()) <= max_words:
            out.append((rec["prompt"], text))
    return out


def asked_families(subjects: Sequence[str] = SUBJECTS) -> dict[str, list[str]]:
    """The families before any answer: the ``ask`` prompts (every kind for each subject in turn, so
    any prefix holds every kind); the grown families empty (:func:`grow_asked` fills them)."""
    ask = [tpl.format(s=s) for s in subjects for tpl in ASK + (GERMAN_ASK,)]
    return {"ask": ask, "asked": [], "summarize": [], "rag": [], "de-en": []}


def grow_asked(families: dict[str, list[str]], records: Sequence[dict], tokenizer) -> None:
    """Fill the grown families of ``families`` (:func:`asked_families`) from ``records``, in place."""
    in_german = GERMAN_ASK.split("{s}")[0]  # the German requests' common start
    lists = {p for p in families["ask"] if not p.startswith(in_german)}
    asked: list[str] = []
    german: list[str] = []
    for rec in records:
        if rec["prompt"] in lists:
            asked += listed_requests(_answer(rec, tokenizer))
        elif rec["prompt"].startswith(in_german):
            german += german_sentences(_answer(rec, tokenizer))
    asked = list(dict.fromkeys(a for a in asked if a not in lists))
    prose = prose_answers(records, tokenizer, set(asked))
    summarize = [SUMMARIZE[i % len(SUMMARIZE)].format(text=text) for i, (_, text) in enumerate(prose)]
    rag = []
    for i, (question, text) in enumerate(prose[2:], start=2):  # the answer and the two answers before it
        docs = [prose[i - 2][1], text, prose[i - 1][1]] if i % 2 else [text, prose[i - 1][1], prose[i - 2][1]]
        listed = "\n\n".join(f"Document {j + 1}: {d}" for j, d in enumerate(docs))
        q = question if i % 2 else question[0].lower() + question[1:]
        rag.append(RAG[i % len(RAG)].format(docs=listed, q=q))
    families.update(asked=asked, summarize=summarize, rag=rag, **{"de-en": de_en_prompts(german)})
