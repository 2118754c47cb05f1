"""A drafter's training corpus made here: the target's own greedy answers to prompts that are not
the evaluation set, in the families the drafters are used for, up to a number of answer tokens.

Families (:func:`corpus_families`; deterministic for a Python version and ``seed``):

* ``chat``        blog posts, emails, stories, explanations, role play, short questions
                  (``prompts.english_prompt_families``, both of its disjoint parts);
* ``code``        coding instructions from Python standard-library docstrings (``data.stdlib_prompts``);
* ``code-edit``   editing code: a standard-library function's source to annotate, refactor, test
                  or explain (:func:`code_edit_prompts`);
* ``en-de``       MCSD's English→German WMT prompts minus Spec-Bench's sentences (``data.wmt_prompts``);
* ``de-en``       German→English translation of the target's own German: its answers to ``en-de``
                  and the sentences of its ``de-write`` prose, in the order they are made (added as
                  they are made, so no evaluation sentence is used);
* ``docs``        summarizing a passage of the Python reference manual, or answering from it (RAG);
* ``math``        templated multi-step arithmetic word problems with fresh numbers;
* ``de-write``    short German prose (paragraphs, letters) on the chat subjects: German sources for
                  ``de-en`` (``prompts.german_writing_prompts``).

``chat`` also holds a third set of subjects (``prompts.more_chat_prompts``) after the first two.

:func:`make_corpus` answers the families interleaved (so that any prefix is balanced) with a
decoder, through ``data.distill`` (speculant's batched engine on the native runtime, one target
pass per step for a whole batch; resumable: prompts already answered are skipped), until the
answers hold ``tokens`` tokens, and keeps ``manifest.json`` beside ``corpus.jsonl`` (tokens and
records by family, the model, the machine, the time it took, the sources and their licences).
"""

from __future__ import annotations

import inspect
import json
import os
import platform
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from ..provenance import machine_info
from .corpus_pack import pack, read_packed, unpack
from .data import STDLIB_MODULES, public_callables, distill, german_answer, importable, load_records, rewrite_records, \
    stdlib_prompts, wmt_prompts
from .asked import asked_families, grow_asked
from .prompts import de_en_prompts, english_prompt_families, german_sentences, german_writing_prompts, \
    more_chat_prompts

__all__ = ["ASKED_SOURCES", "CORPUS_NAME", "FAMILY_SETS", "MANIFEST_NAME", "PACKED_NAME", "SOURCES",
           "code_edit_prompts", "corpus_families", "german_sources",
           "make_corpus"]

CORPUS_NAME, MANIFEST_NAME, PACKED_NAME = "corpus.jsonl", "manifest.json", "answers.jsonl.gz"
SOURCES = {
    "chat": "prompts written for speculant (speculant.training.prompts), Apache-2.0 like the project",
    "code": "first paragraphs of CPython standard-library docstrings (PSF License v2)",
    "code-edit": "CPython standard-library function sources (PSF License v2)",
    "en-de": "MCSD's WMT English→German prompts (NJUNLP/MCSD, MIT), Spec-Bench's sentences removed",
    "de-en": "the target's own German: its answers to the en-de prompts and the sentences of its de-write prose",
    "docs": "passages of the Python reference manual, pydoc_data.topics (PSF License v2)",
    "math": "templated word problems written for speculant, seeded numbers",
    "de-write": "prompts written for speculant asking for German prose, Apache-2.0 like the project",
}
ASKED_SOURCES = {
    "ask": "subjects and list requests written for speculant (speculant.training.asked), Apache-2.0 like the project",
    "asked": "the requests the target listed in its answers to the ask prompts",
    "summarize": "the target's own prose answers to the asked prompts",
    "rag": "the target's own prose answers to the asked prompts, three per prompt, and one of their questions",
    "de-en": "the sentences of the target's own German paragraphs (ask prompts in German)",
}
FAMILY_SETS = ("drafter", "asked", "human")  # corpus_families (module docstring); training.asked; human_prompts
EDIT_TASKS = (
    "Add type hints and a docstring to this Python function, changing nothing else:\n\n```python\n{src}```",
    "Rewrite this Python function to be easier to read, keeping its behaviour:\n\n```python\n{src}```",
    "Write pytest unit tests for this Python function:\n\n```python\n{src}```",
    "Explain what this Python function does, step by step:\n\n```python\n{src}```",
)


def code_edit_prompts(modules: Sequence[str] = STDLIB_MODULES, min_lines: int = 4, max_lines: int = 30) -> list[str]:
    """Code-editing tasks on the sources of the public functions of ``modules`` (``min_lines`` to
    ``max_lines`` lines each), the tasks rotated. Modules that cannot be imported are skipped."""
    out: list[str] = []
    seen: set[str] = set()
    for module, mod in importable(modules):
        for _, obj in public_callables(module, mod):
            if not inspect.isfunction(obj):
                continue
            try:
                src = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            if not min_lines <= src.count("\n") <= max_lines or src in seen:
                continue
            seen.add(src)
            out.append(EDIT_TASKS[len(out) % len(EDIT_TASKS)].format(src=src))
    return out


def corpus_families(german: Sequence[str] = (), seed: int = 0, math_sets: int = 5) -> dict[str, list[str]]:
    """Every family's prompts by name (module docstring); ``german``: the German sentences of the
    ``de-en`` family; ``math_sets``: sets of 120 word problems per part, each with other numbers."""
    parts = [english_prompt_families((), seed, part) for part in (0, 1)]
    math = [p for s in range(math_sets) for part in (0, 1) for p in english_prompt_families((), seed + s, part)["math"]]
    return {
        "chat": [p for f in parts for k in ("write", "explain", "role", "qa") for p in f[k]] + more_chat_prompts(),
        "code": stdlib_prompts(),
        "code-edit": code_edit_prompts(),
        "en-de": wmt_prompts(),
        "de-en": de_en_prompts(german),
        "docs": [p for f in parts for k in ("summarize", "rag") for p in f[k]],
        "math": list(dict.fromkeys(math)),
        "de-write": german_writing_prompts(),
    }


def german_sources(records: list[dict], tokenizer, prose: set[str]) -> list[str]:
    """The target's own German in ``records``, in file order: each one-line answer to an ``en-de``
    prompt, and the stand-alone sentences of each answer to a prompt in ``prose`` (``de-write``)."""
    out = []
    for rec in records:
        if (answer := german_answer(rec, tokenizer)) is not None:
            out.append(answer)
        elif rec["prompt"] in prose:
            out += german_sentences(tokenizer.decode(rec["ids"][rec["prompt_len"]:], skip_special_tokens=True))
    return out


def interleave(families: dict[str, list[str]], block: int) -> list[tuple[str, str]]:
    """(family, prompt) pairs, ``block`` prompts of each family in turn; duplicates dropped."""
    out, seen = [], set()
    for i in range(0, max((len(v) for v in families.values()), default=0), block):
        for name, prompts in families.items():
            for p in prompts[i:i + block]:
                if p not in seen:
                    seen.add(p)
                    out.append((name, p))
    return out


def _family_set(name: str, seed: int):
    """(families, grow, sources, notes) of the family set ``name`` (:data:`FAMILY_SETS`): its prompts by
    family before any answer, ``grow(families, records, tokenizer)`` filling in place the families
    made from the target's answers, each family's source, and what else the manifest records."""
    if name == "human":
        from .conversations import SOURCES as CONVERSATION_SOURCES, MAX_PROMPT_CHARS, ConversationFilter, \
            eval_exclusion, human_prompts

        filt = ConversationFilter()
        prompts, counts = human_prompts(seed, filt)
        source = CONVERSATION_SOURCES["sharegpt"]
        notes = {"filter": {"first_human_turns": counts, "overlap_n": filt.overlap_n, "max_foreign": filt.max_foreign,
                            "max_chars": MAX_PROMPT_CHARS},
                 "evaluation_set_excluded": eval_exclusion(filt.overlap_n)}
        return {"sharegpt": prompts}, lambda *_: None, {
            "sharegpt": f"the first human turns of {source['package']} ({source['what']}); licence: "
                        f"{source['licence']}; the answers are the target's own"}, notes
    if name == "drafter":
        families = corpus_families((), seed)
        prose = set(families.get("de-write", ()))

        def grow(fams: dict[str, list[str]], records: list[dict], tokenizer) -> None:
            fams["de-en"] = de_en_prompts(german_sources(records, tokenizer, prose))

        return families, grow, SOURCES, {}
    if name == "asked":
        return asked_families(), grow_asked, ASKED_SOURCES, {}
    raise ValueError(f"unknown family set {name!r}: use one of {', '.join(FAMILY_SETS)}")


def _answer_tokens(records: list[dict]) -> int:
    return sum(len(r["ids"]) - r["prompt_len"] for r in records)


def _write_json(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


def make_corpus(decoder, out: str | os.PathLike, tokens: int, *, batch_size: int = 16, max_new_tokens: int = 512,
                seed: int = 0, progress: bool = True, describe: dict | None = None, families: str = "drafter",
                packed: str | os.PathLike | None = None) -> dict:
    """Answer the families' prompts with ``decoder`` (a ``SpeculativeDecoder`` with
    ``chat=True``; greedy) into ``out/corpus.jsonl`` until the answers hold ``tokens`` tokens (or the
    prompts run out); resumable. ``describe``: what to record about the model and the command.
    ``families``: which set of families (:data:`FAMILY_SETS`): ``"drafter"`` (this module's) or
    ``"asked"`` (self-instructed prose, :mod:`speculant.training.asked`) or ``"human"`` (the first
    human turns of ShareGPT, :func:`speculant.training.conversations.human_prompts`).
    ``packed``: a directory holding the answers without their prompts (:mod:`.corpus_pack`,
    ``answers.jsonl.gz``) and the manifest, for committing a corpus whose prompts are not ours:
    its answers are taken in first (nothing is answered twice) and it is rewritten with the manifest.
    Returns the manifest (also written to ``out/manifest.json`` after every batch)."""
    prompts, grow, sources, notes = _family_set(families, seed)  # an unknown set is refused before anything is written
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    path, manifest_path = directory / CORPUS_NAME, directory / MANIFEST_NAME
    if packed is not None:
        _take_packed(Path(packed), path, manifest_path, prompts, decoder)
    old = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    legacy = [{k: old.get(k) for k in ("machine", "seconds", "records", "answer_tokens")}] if "seconds" in old else []
    runs = list(old.get("runs") or legacy)  # a manifest without runs: all its time was one run
    start, cpu0 = time.perf_counter(), time.process_time()
    started = old.get("started") or datetime.now(timezone.utc).isoformat(timespec="seconds")
    this_run = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info()}
    first = None  # records and answer tokens before this run
    while True:
        records = load_records(path)
        grow(prompts, records, decoder.tokenizer)  # the families that grow with the target's answers
        order = interleave(prompts, batch_size)
        family = {p: f for f, p in order}
        done = {r["prompt"] for r in records}
        todo = [p for _, p in order if p not in done]
        have = _answer_tokens(records)
        first = first or (len(records), have)
        this_run.update(seconds=round(time.perf_counter() - start, 1),
                        cpu_seconds=round(time.process_time() - cpu0, 1), records=len(records) - first[0],
                        answer_tokens=have - first[1])
        answered = this_run["records"] > 0  # a run that answered nothing (a restore from packed) is not one
        manifest = _manifest(records, family, tokens, started, runs + [this_run] * answered,
                             {**notes, **(describe or {})}, decoder, sources)
        manifest["prompts_left"] = len(todo)  # 0 below the goal: the families' prompts ran out
        _write_json(manifest_path, manifest)
        if packed is not None and answered:  # the same state as the manifest's; a restore leaves it as it is
            pack(records, Path(packed) / PACKED_NAME)
            _write_json(Path(packed) / MANIFEST_NAME, manifest)
        if have >= tokens or not todo:
            return manifest
        # a group of 4 batches per call: the batch refills as answers end (records written per group)
        distill(decoder, todo[:4 * batch_size], max_new_tokens, path, progress=progress, batch_size=batch_size,
                group=4 * batch_size)


def _take_packed(packed: Path, path: Path, manifest_path: Path, families: dict[str, list[str]], decoder) -> None:
    """Add to the corpus at ``path`` the answers in ``packed`` (a directory) to prompts of
    ``families`` it lacks, and take the packed manifest (its runs) where the corpus has none."""
    if not (packed / PACKED_NAME).is_file():
        return
    records = load_records(path)
    done = {r["prompt"] for r in records}
    wanted = [p for ps in families.values() for p in ps if p not in done]
    new = unpack(read_packed(packed / PACKED_NAME), wanted, lambda p: decoder.encode(p).tolist())
    if new:
        rewrite_records(path, records + new)
    if not manifest_path.is_file() and (packed / MANIFEST_NAME).is_file():
        _write_json(manifest_path, json.loads((packed / MANIFEST_NAME).read_text()))


def _manifest(records: list[dict], family: dict[str, str], goal: int, started: str, runs: list[dict],
              describe: dict, decoder, sources: dict[str, str]) -> dict:
    """The manifest; ``runs``: every run of the command on this corpus (its machine, start, wall
    seconds, CPU seconds of all its threads, and the records and answer tokens it added), the
    current one last. CPU-hours: the runs' CPU seconds; a run recorded without them counts its
    wall time on every core (a run that was paused meanwhile is counted high)."""
    by = {}
    for r in records:
        f = family.get(r["prompt"], "other")
        n, t = by.get(f, (0, 0))
        by[f] = (n + 1, t + len(r["ids"]) - r["prompt_len"])
    seconds = sum(run["seconds"] for run in runs)
    cpu_seconds = sum(run["cpu_seconds"] if "cpu_seconds" in run
                      else run["seconds"] * ((run.get("machine") or {}).get("cores") or 1) for run in runs)
    return {
        "goal_answer_tokens": goal,
        "answer_tokens": _answer_tokens(records),
        "records": len(records),
        "by_family": {f: {"records": n, "answer_tokens": t} for f, (n, t) in sorted(by.items())},
        "target": decoder.target.name,
        "greedy": True,
        **describe,
        "python": platform.python_version(),
        "started": started,
        "updated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "cpu_hours": round(cpu_seconds / 3600, 3),
        "runs": runs,
        "sources": sources,
    }
