"""Fill-in-the-middle prompts, built from the model's own FIM tokens.

A code model trained for infilling marks the text before the gap, the text after it and the
start of the middle with special tokens of its vocabulary; it then writes the middle and ends it
with its end-of-sequence token (or one of its FIM markers). The spellings known here:

- Qwen2.5-Coder: ``<|fim_prefix|>``, ``<|fim_suffix|>``, ``<|fim_middle|>`` (with ``<|repo_name|>``
  and ``<|file_sep|>`` for repository context);
- StarCoder / StarCoder2: ``<fim_prefix>``, ``<fim_suffix>``, ``<fim_middle>`` (StarCoder2 with
  ``<repo_name>`` and ``<file_sep>``); SantaCoder: ``<fim-prefix>``, ``<fim-suffix>``, ``<fim-middle>``;
- DeepSeek-Coder: ``<｜fim▁begin｜>``, ``<｜fim▁hole｜>``, ``<｜fim▁end｜>``;
- CodeLlama: ``<PRE>``, ``<SUF>``, ``<MID>`` (in SentencePiece vocabularies ``▁<PRE>`` ...), ended by ``<EOT>``.

The prompt is prefix-suffix-middle: ``[context]<PRE>prefix<SUF>suffix<MID>middle``, where
``middle`` is text of the middle already written (``/infill``'s ``prompt``) and the context is
other files of the repository (``/infill``'s ``input_extra``): with repository tokens as the
model was trained on them, ``<REPO>project\\n<SEP>path\\ntext...<SEP>current\\n``, else their texts
one after the other. Each piece of text is tokenized on its own and the markers are inserted as
token ids, so text that merely looks like a marker stays text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

# (prefix, suffix, middle, repository name, file separator, further tokens that end an infill)
SPELLINGS: tuple[tuple[str, str, str, str | None, str | None, tuple[str, ...]], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>", ("<|fim_pad|>",)),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>", "<file_sep>", ("<fim_pad>",)),
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>", None, None, ("<fim-pad>",)),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None, ()),
    ("▁<PRE>", "▁<SUF>", "▁<MID>", None, None, ("▁<EOT>",)),
    ("<PRE>", "<SUF>", "<MID>", None, None, ("<EOT>",)),
)
REPOSITORY = "project"  # the repository's name in a repository-level prompt (the request gives none)
CURRENT_FILE = "current"  # the file being filled's path there (likewise)


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's fill-in-the-middle token ids (``names``: their spellings, for messages)."""
    prefix: int
    suffix: int
    middle: int
    repo: int | None = None
    file_sep: int | None = None
    ends: frozenset[int] = frozenset()  # every marker: none of them belongs in a middle
    names: tuple[str, str, str] = ("", "", "")


def fim_tokens(tokenizer: Any, vocab_size: int | None = None) -> FimTokens | None:
    """The tokenizer's FIM tokens, looked up in its vocabulary (the first spelling it has all
    three of, each an id below ``vocab_size``); None if it has none."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 -- a tokenizer without a readable vocabulary has no FIM tokens here
        return None

    def find(token: str | None) -> int | None:
        i = vocab.get(token) if token is not None else None
        return i if i is not None and (vocab_size is None or i < vocab_size) else None

    for pre, suf, mid, repo, sep, more in SPELLINGS:
        ids = [find(pre), find(suf), find(mid)]
        if None in ids:
            continue
        repo_id, sep_id = find(repo), find(sep)
        if repo_id is None or sep_id is None:
            repo_id = sep_id = None
        ends = {*ids, *(i for i in (repo_id, sep_id) if i is not None), *(i for i in map(find, more) if i is not None)}
        return FimTokens(ids[0], ids[1], ids[2], repo_id, sep_id, frozenset(ends), (pre, suf, mid))
    return None


def fim_prompt(tokenizer: Any, fim: FimTokens, prefix: str, suffix: str, middle: str = "",
               extra: Sequence[tuple[str, str]] = ()) -> list[int]:
    """The token ids of the prompt that asks for the text between ``prefix`` and ``suffix``
    (module doc); ``extra``: (file name, text) of other files, as context."""
    ids = leading_tokens(tokenizer)
    if extra:
        if fim.repo is not None and fim.file_sep is not None:
            ids += [fim.repo] + _encode(tokenizer, REPOSITORY + "\n")
            for name, text in extra:
                ids += [fim.file_sep] + _encode(tokenizer, f"{name}\n{_line_ended(text)}")
            ids += [fim.file_sep] + _encode(tokenizer, CURRENT_FILE + "\n")
        else:
            ids += _encode(tokenizer, "".join(_line_ended(text) for _, text in extra))
    ids += [fim.prefix] + _encode(tokenizer, prefix) + [fim.suffix] + _encode(tokenizer, suffix)
    return ids + [fim.middle] + _encode(tokenizer, middle)


def leading_tokens(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer puts before a text (a BOS), if any."""
    plain = tokenizer("x", add_special_tokens=False).input_ids
    full = tokenizer("x", add_special_tokens=True).input_ids
    if len(full) > len(plain) and full[len(full) - len(plain):] == plain:
        return list(full[:len(full) - len(plain)])
    return []


def _encode(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids, a special token's spelling in it tokenized as text."""
    if not text:
        return []
    try:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids)
    except TypeError:  # a tokenizer without the option
        return list(tokenizer(text, add_special_tokens=False).input_ids)


def _line_ended(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"
