"""Self-distillation data for head training: prompts that are NOT the evaluation set, answered by
the target itself with our own (lossless, greedy) engine.

Prompt sources (never Spec-Bench, the evaluation set):

* :func:`stdlib_prompts`: coding instructions written from the docstrings of the public functions,
  classes and methods of a fixed list of Python standard-library modules (present on every
  machine). Deterministic for a given Python version: modules in list order, names sorted,
  duplicates (same object or same docstring paragraph) dropped, templates rotated by index.
* :func:`wmt_prompts`: MCSD's 1000 English→German WMT prompts (bundled ``data/mcsd_wmt_ende.json``,
  MIT). Spec-Bench's translation questions come from the same WMT test set (German→English): the
  prompts whose English sentence occurs in Spec-Bench (as a question or a reference) are dropped.

:func:`distill` writes one JSON object per line, ``{"prompt", "prompt_len", "ids",
"finish_reason"}`` with ``ids`` = prompt token ids + answer token ids (``ids[:prompt_len]`` is the
prompt); it appends as it goes and skips prompts already in the file, so it can be resumed.

For training, :func:`windows` cuts records into windows of at most ``seq_len`` tokens with their
target masks, :func:`collate` pads a list of windows into (B, T) tensors and :class:`Batches`
serves seeded, resumable, per-process micro-batches.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import math
import tempfile
from importlib import resources
from pathlib import Path
from typing import Iterable, Sequence

import torch

__all__ = ["STDLIB_MODULES", "Batches", "collate", "distill", "german_answer", "german_answers", "jsonl_lines",
           "load_records", "mixed_prompts", "rewrite_records", "stdlib_prompts", "windows", "wmt_prompts"]

STDLIB_MODULES = (
    "json", "re", "string", "textwrap", "itertools", "functools", "collections", "math", "statistics",
    "random", "datetime", "calendar", "pathlib", "os.path", "shutil", "glob", "fnmatch", "csv", "heapq",
    "bisect", "operator", "base64", "binascii", "hashlib", "hmac", "secrets", "uuid", "urllib.parse",
    "difflib", "fractions", "decimal", "cmath", "html", "html.parser", "copy", "zlib", "gzip", "struct",
    "time", "enum", "dataclasses", "typing", "contextlib", "inspect", "shlex", "argparse", "logging",
    "tempfile", "io", "sqlite3", "ipaddress", "email.utils", "colorsys", "pprint", "unicodedata", "array",
    "zipfile", "configparser", "graphlib", "queue", "threading", "subprocess", "socket", "select",
    "asyncio", "concurrent.futures", "xml.etree.ElementTree", "mimetypes", "locale", "gettext",
    "platform", "sys", "weakref", "abc", "numbers", "traceback", "warnings", "timeit", "pickle",
    "shelve", "tokenize", "ast", "dis", "keyword", "codecs", "quopri", "netrc", "plistlib", "wave",
)

TEMPLATES = (
    "Write a Python {kind} like `{qual}`: {doc}",
    "Explain what `{qual}` does in Python and show a short example of using it. Its documentation "
    "says: {doc}",
    "Implement `{name}` yourself in Python, without using `{module}`. It should behave as documented: "
    "{doc}",
    "Write pytest unit tests for `{qual}`, whose documentation says: {doc}",
)

_SIGNATURE = re.compile(r"^[\w.]+\(.*\)\s*(->|-->)")  # "chain(*iterables) --> chain object"


def _first_paragraph(doc: str | None, min_chars: int = 30, max_chars: int = 600) -> str | None:
    """The first docstring paragraph that is prose (not a signature line), on one line."""
    for para in (doc or "").split("\n\n"):
        text = " ".join(line.strip() for line in para.strip().splitlines())
        if not text or _SIGNATURE.match(text):
            continue
        return text if min_chars <= len(text) <= max_chars else None
    return None


def _own(module: str, owner, name: str, value) -> bool:
    """Is ``value`` really ``owner``'s (listed in a module's ``__all__``, defined in the module or
    its C accelerator, or in the class body) rather than imported or inherited?"""
    if inspect.isclass(owner):
        return name in vars(owner)
    listed = getattr(owner, "__all__", None)
    if listed is not None:
        return name in listed
    home = (getattr(value, "__module__", None) or "").lstrip("_")
    return home == module or home.startswith(module + ".")


def public_callables(module: str, owner) -> list[tuple[str, object]]:
    """Sorted public callables of a module or class that belong to it."""
    out = []
    for name in sorted(n for n in dir(owner) if not n.startswith("_")):
        try:
            value = inspect.getattr_static(owner, name)
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
        except AttributeError:
            continue
        if callable(value) and not inspect.ismodule(value) and _own(module, owner, name, value):
            out.append((name, value))
    return out


def importable(modules: Sequence[str]):
    """(name, module) of ``modules`` in order, skipping those this Python cannot import."""
    for module in modules:
        try:
            yield module, importlib.import_module(module)
        except Exception:  # noqa: BLE001 - e.g. a module missing from a minimal Python build
            continue


def stdlib_prompts(modules: Sequence[str] = STDLIB_MODULES, limit: int | None = None) -> list[str]:
    """Instructions from stdlib docstrings: module functions, classes and their public methods.

    Deterministic, duplicate-free, in ``modules`` order; at most ``limit`` prompts. Modules that
    cannot be imported on this machine are skipped.
    """
    prompts: list[str] = []
    seen_objects: set[int] = set()
    seen_docs: set[str] = set()

    def add(module: str, qual: str, name: str, obj) -> None:
        doc = _first_paragraph(inspect.getdoc(obj))
        if doc is None or id(obj) in seen_objects or doc in seen_docs:
            return
        seen_objects.add(id(obj))
        seen_docs.add(doc)
        template = TEMPLATES[len(prompts) % len(TEMPLATES)]
        kind = "class" if inspect.isclass(obj) else "function"
        prompts.append(template.format(qual=qual, name=name, module=module, doc=doc, kind=kind))

    for module, mod in importable(modules):
        for name, obj in public_callables(module, mod):
            add(module, f"{module}.{name}", name, obj)
            if inspect.isclass(obj):  # and the methods its body defines
                for meth_name, meth in public_callables(module, obj):
                    if not inspect.isclass(meth):
                        add(module, f"{module}.{name}.{meth_name}", f"{name}.{meth_name}", meth)
        if limit is not None and len(prompts) >= limit:
            break
    return prompts[:limit]


def _norm(text: str) -> str:
    return re.sub(r"[^0-9a-z]", "", text.lower())


def _strings(x) -> Iterable[str]:
    if isinstance(x, str):
        yield x
    elif isinstance(x, list):
        for y in x:
            yield from _strings(y)


def _spec_bench_text() -> str:
    """Every question turn and reference of the bundled Spec-Bench, normalised, in one string."""
    raw = resources.files("speculant").joinpath("data/spec_bench_questions.jsonl").read_text("utf-8")
    parts = []
    for line in jsonl_lines(raw):
        if line.strip():
            q = json.loads(line)
            parts += [_norm(s) for s in (*_strings(q.get("turns")), *_strings(q.get("reference")))]
    return "\n".join(parts)


def wmt_prompts(limit: int | None = None, exclude_eval: bool = True) -> list[str]:
    """MCSD's English→German prompts ("Translate the input English sentence into German.\\nInput:
    ...\\nOutput: "), minus those whose sentence occurs in Spec-Bench (``exclude_eval``)."""
    prompts = json.loads(resources.files("speculant").joinpath("data/mcsd_wmt_ende.json").read_text("utf-8"))
    if exclude_eval:
        eval_text = _spec_bench_text()

        def sentence(p: str) -> str:
            return _norm(p.split("Input:", 1)[-1].rsplit("Output:", 1)[0])

        prompts = [p for p in prompts if sentence(p) not in eval_text]
    return prompts[:limit]


def mixed_prompts(n_stdlib: int | None = None, n_wmt: int | None = None) -> list[str]:
    """``stdlib_prompts(n_stdlib)`` and ``wmt_prompts(n_wmt)`` interleaved (deterministic), so a
    prefix of the list (an interrupted distillation) holds both kinds."""
    a, b = stdlib_prompts(limit=n_stdlib), wmt_prompts(limit=n_wmt)
    out = [p for pair in zip(a, b) for p in pair]
    n = min(len(a), len(b))
    return out + a[n:] + b[n:]


EN_DE_INSTRUCTION = "Translate the input English sentence into German"  # how MCSD's WMT prompts begin


def german_answer(rec: dict, tokenizer) -> str | None:
    """The German answer (decoded, one line) of a WMT en->de record; None for any other record or
    an answer of several lines."""
    if not rec["prompt"].startswith(EN_DE_INSTRUCTION):
        return None
    text = tokenizer.decode(rec["ids"][rec["prompt_len"]:], skip_special_tokens=True).strip()
    return text if text and "\n" not in text else None


def german_answers(path: str | os.PathLike, tokenizer) -> list[str]:
    """The German answers (decoded, one line each) of the WMT en->de records of a distillation file,
    in file order: sources for German->English prompts that are the target's own German."""
    return [g for rec in load_records(path) if (g := german_answer(rec, tokenizer)) is not None]


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSON Lines text, split at "\\n" only: ``str.splitlines`` also splits at
    U+2028, U+2029, U+0085, form feeds and more, which JSON keeps unescaped inside strings (an
    answer holding one would be cut in two and lost)."""
    return [line for line in text.split("\n") if line.strip()]


def load_records(path: str | os.PathLike) -> list[dict]:
    """The valid records of a distillation JSONL file (a torn last line is ignored); [] if absent."""
    p = Path(path)
    if not p.is_file():
        return []
    records = []
    for line in jsonl_lines(p.read_text("utf-8")):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("ids"), list) and "prompt_len" in rec:
            records.append(rec)
    return records


def rewrite_records(path: Path, records: list[dict]) -> None:
    """Replace ``path`` atomically by ``records`` (drops a torn line left by a crash)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    os.replace(tmp, path)


def _answer_batch(decoder, prompts: Sequence[str], max_new_tokens: int) -> list[dict]:
    """Greedy answers for several prompts in one batched ``generate`` of the target (left padding).

    On AMX a bf16 pass over 16 sequences costs about what one costs, so this is ~batch-size times
    the throughput of one-sequence decoding. It is transformers' batched generation, not our
    engine: bf16 batches may round a near-tie differently from single-sequence decoding, which is
    harmless for training data.
    """
    model, tok = decoder.target.model, decoder.tokenizer
    encs = [decoder.encode(p) for p in prompts]
    T = max(len(e) for e in encs)
    eos = sorted(decoder.eos_token_ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    ids = torch.full((len(encs), T), pad, dtype=torch.long)
    attn = torch.zeros(len(encs), T, dtype=torch.long)
    for i, e in enumerate(encs):
        ids[i, T - len(e):], attn[i, T - len(e):] = e, 1
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=attn, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=pad, eos_token_id=eos)[:, T:].tolist()
    recs = []
    for prompt, e, gen in zip(prompts, encs, out):
        stop = next((j for j, t in enumerate(gen) if t in eos), None)
        answer = gen[:stop + 1] if stop is not None else gen[:max_new_tokens]
        recs.append({"prompt": prompt, "prompt_len": len(e), "ids": e.tolist() + answer,
                     "finish_reason": "eos" if stop is not None else "length"})
    return recs


def _answer_together(decoder, prompts: Sequence[str], max_new_tokens: int, max_batch: int | None = None) -> list[dict]:
    """Greedy answers for several prompts with speculant's batched engine: one target pass per
    step for up to ``max_batch`` of them (the next joins as one ends), each answer exactly what
    one-prompt decoding gives."""
    results = decoder.generate_batch(list(prompts), max_new_tokens, max_batch=max_batch)
    return [{"prompt": p, "prompt_len": r.prompt_tokens, "ids": decoder.encode(p).tolist() + list(r.token_ids),
             "finish_reason": r.finish_reason} for p, r in zip(prompts, results)]


def distill(decoder, prompts: Sequence[str], max_new_tokens: int, path: str | os.PathLike | None = None,
            *, progress: bool = True, batch_size: int = 1, group: int | None = None) -> list[list[int]]:
    """Answer ``prompts`` greedily with ``decoder`` (a ``speculant.SpeculativeDecoder``, e.g.
    ``method="lookup"`` or ``"ar"``, ``chat=True``); return one token-id list per prompt (prompt
    ids + answer ids, in ``prompts`` order). ``batch_size > 1`` answers that many prompts at once:
    on the native runtime with speculant's batched engine (``generate_batch``: each answer the one
    decoding it alone gives), on transformers with its batched ``generate`` (``_answer_batch``).

    ``group`` (> ``batch_size``, speculant's engine only): hand it this many prompts per call, of
    which ``batch_size`` decode at a time and the next joins as one ends, so the batch stays full
    while answers end at different lengths (records are written per group).

    With ``path``, records are appended to that JSONL file as they are made and prompts already in
    it are not generated again (resume after an interruption).
    """
    from tqdm.auto import tqdm

    done: dict[str, dict] = {}
    out_path = Path(path) if path is not None else None
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        records = load_records(out_path)
        done = {r["prompt"]: r for r in records}
        if out_path.is_file() and len(jsonl_lines(out_path.read_text("utf-8"))) != len(records):
            rewrite_records(out_path, records)
    todo = [p for p in dict.fromkeys(prompts) if p not in done]
    f = out_path.open("a", encoding="utf-8") if out_path is not None else None
    try:
        bar = tqdm(total=len(todo), desc="distilling", unit="prompt", disable=not progress or not todo)
        together = batch_size > 1 and decoder.target_backend.shares_passes
        step = max(group or batch_size, batch_size) if together else batch_size
        for a in range(0, len(todo), step):
            chunk = todo[a:a + step]
            if together:
                recs = _answer_together(decoder, chunk, max_new_tokens, max_batch=batch_size)
            elif batch_size > 1:
                recs = _answer_batch(decoder, chunk, max_new_tokens)
            else:
                ids = decoder.encode(chunk[0]).tolist()
                result = decoder.generate(chunk[0], max_new_tokens)  # greedy: temperature 0
                recs = [{"prompt": chunk[0], "prompt_len": len(ids), "ids": ids + list(result.token_ids),
                         "finish_reason": result.finish_reason}]
            for rec in recs:
                done[rec["prompt"]] = rec
                if f is not None:
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            if f is not None:
                f.flush()
            bar.update(len(chunk))
        bar.close()
    finally:
        if f is not None:
            f.close()
    return [done[p]["ids"] for p in prompts]


def windows(records: list[dict], seq_len: int, train_on_prompt: bool = False) -> list[tuple[list[int], list[bool]]]:
    """Cut each record into windows of <= ``seq_len`` tokens, each with its target mask (True on
    answer tokens, or on every token with ``train_on_prompt``); windows without a target dropped."""
    out = []
    for rec in records:
        ids, start = rec["ids"], 0 if train_on_prompt else int(rec["prompt_len"])
        mask = [j >= start for j in range(len(ids))]
        for a in range(0, len(ids), seq_len):
            w, m = ids[a:a + seq_len], mask[a:a + seq_len]
            if len(w) >= 3 and any(m[2:]):
                out.append((w, m))
    return out


def collate(items: list[tuple[list[int], list[bool]]]) -> tuple[torch.Tensor, ...]:
    """-> ids (B, T) long, attention (B, T) long, mask (B, T) bool; padded on the right."""
    T = max(len(w) for w, _ in items)
    ids = torch.zeros(len(items), T, dtype=torch.long)
    attn = torch.zeros(len(items), T, dtype=torch.long)
    mask = torch.zeros(len(items), T, dtype=torch.bool)
    for b, (w, m) in enumerate(items):
        ids[b, :len(w)], attn[b, :len(w)], mask[b, :len(m)] = torch.tensor(w), 1, torch.tensor(m)
    return ids, attn, mask


class Batches:
    """Micro-batch ``m`` of process ``p`` of ``W`` is global batch ``m·W + p``; every epoch is a
    seeded permutation of the windows, so any step can be recomputed (resume)."""

    def __init__(self, items: list[tuple[list[int], list[bool]]], batch_size: int, seed: int,
                 rank: int = 0, world: int = 1):
        self.windows, self.B, self.seed, self.rank, self.world = items, batch_size, seed, rank, world
        self.per_epoch = math.ceil(len(items) / batch_size)
        self._perm: tuple[int, torch.Tensor] | None = None

    def indices(self, m: int) -> list[int]:
        """The window indices of micro-batch ``m`` of this process."""
        epoch, i = divmod(m * self.world + self.rank, self.per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(len(self.windows), generator=g))
        return self._perm[1][i * self.B:(i + 1) * self.B].tolist()

    def __getitem__(self, m: int) -> tuple[torch.Tensor, ...]:
        return collate([self.windows[j] for j in self.indices(m)])
