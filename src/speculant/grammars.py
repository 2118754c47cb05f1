"""Grammar engines behind one small protocol: a compiled grammar and its matchers.

A *matcher* is the grammar's state after some tokens. The decoding loop needs five things of it
(:class:`Matcher`): the next-token bitmask, advancing by a token it allows, rolling back, whether
the text so far may end here, and whether nothing but the end may follow. Each of a verified
tree's nodes gets its row masked by visiting the tree depth-first from the committed state
(advance, fill, roll back: ``constraints``), so an engine must roll back cheaply and never be
broken by a token it refuses (``advance`` checks first).

Engines (``ENGINES``):

* ``llguidance`` (the default; pinned in pyproject): an Earley parser over a token trie with
  unlimited rollback and ``deep_copy``; JSON Schema, regex and Lark grammars (GBNF is converted to
  Lark by the library). It has no Python dependencies, so its pin cannot move torch.
* ``xgrammar``: the same matcher API shape (``accept_token``/``rollback``/``fork``, EBNF, regex,
  JSON Schema); optional, installed by hand with ``pip install --no-deps xgrammar==0.2.9
  apache-tvm-ffi`` (its declared dependencies would pull triton and could move torch).

Which one is cheaper per mask on this CPU is measured by ``tools/grammar_mask_cost.py``.

Bitmask layout (both engines): int32 words, ``ceil(V / 32)`` per row; token t is bit ``t % 32``
of word ``t // 32`` (1: allowed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
from torch import Tensor

from .errors import ConfigError

__all__ = ["ENGINES", "GrammarEngine", "GrammarSpec", "Matcher", "CompiledGrammar", "make_engine",
           "mask_words"]

ENGINES = ("llguidance", "xgrammar")
GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. ``kind``: ``json_object`` (any JSON object), ``json_schema``
    (``source``: the schema as JSON text), ``regex`` (``source``: the pattern, matched whole) or
    ``grammar`` (``source``: a Lark grammar, or GBNF for llguidance). ``strict``: for a schema,
    every keyword it uses must be enforced (else ConfigError); not strict, keywords the engine
    does not implement are ignored."""

    kind: str
    source: str = ""
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ConfigError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")


def mask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


class Matcher(Protocol):
    """A grammar state. Never left broken: ``advance`` of a refused token changes nothing."""

    def fill(self, bitmask: Tensor, row: int) -> None: ...   # bitmask (n, W) int32, row ``row`` <- allowed next tokens
    def advance(self, token: int) -> bool: ...               # consume ``token`` if allowed; False (unchanged) if not
    def rollback(self, n: int) -> None: ...                  # undo the last ``n`` advances
    def can_end(self) -> bool: ...                           # the text so far is a complete match
    def ended(self) -> bool: ...                             # nothing but the end may follow
    def error(self) -> str: ...                              # "" unless the engine failed


class CompiledGrammar(Protocol):
    mask_vocab: int                                          # tokens a bitmask row covers (>= the model's V)

    def matcher(self) -> Matcher: ...                        # a fresh state at the grammar's start


class GrammarEngine(Protocol):
    """One per tokenizer (vocabulary size and EOS ids): building it reads the whole vocabulary."""
    name: str
    vocab_size: int

    def compile(self, spec: GrammarSpec) -> CompiledGrammar: ...   # ConfigError for a bad grammar


def make_engine(name: str, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarEngine:
    """The engine ``name`` for a Hugging Face (fast) ``tokenizer`` and a model of ``vocab_size``
    logits (may exceed the tokenizer's; the extra ids are never allowed)."""
    if name == "llguidance":
        return LLGuidanceEngine(tokenizer, vocab_size, eos_token_ids)
    if name == "xgrammar":
        return XGrammarEngine(tokenizer, vocab_size, eos_token_ids)
    raise ConfigError(f"grammar engine must be one of {', '.join(ENGINES)}, got {name!r}")


# ---- llguidance -------------------------------------------------------------------------------
class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        import llguidance.hf

        self.vocab_size = int(vocab_size)
        self.mask_vocab = max(self.vocab_size, len(tokenizer))
        eos = sorted(int(e) for e in eos_token_ids) or None
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.mask_vocab, eos_token=eos)
        except ValueError as e:  # a slow (Python) tokenizer
            raise ConfigError(f"constrained decoding needs a fast tokenizer: {e}") from None

    def compile(self, spec: GrammarSpec) -> "_LLGuidanceGrammar":
        import llguidance

        if spec.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}))
        elif spec.kind == "json_schema":
            lenient = None if spec.strict else {"lenient": True}  # keywords it does not implement: ignored
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.source, overrides=lenient)
        elif spec.kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec.source)
        else:
            from llguidance.gbnf_to_lark import any_to_lark

            try:
                lark = any_to_lark(spec.source)
            except Exception as e:  # noqa: BLE001 -- the converter's own error types
                raise ConfigError(f"response_format grammar: {e}") from None
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise ConfigError(f"response_format {spec.kind}: {messages[0].strip()}")
        start = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if start.is_error():
            raise ConfigError(f"response_format {spec.kind}: {start.get_error()}")
        return _LLGuidanceGrammar(start, self.mask_vocab)


class _LLGuidanceGrammar:
    def __init__(self, start, mask_vocab: int):
        self._start = start  # never advanced: each generation gets a deep copy
        self.mask_vocab = mask_vocab

    def matcher(self) -> "_LLGuidanceMatcher":
        return _LLGuidanceMatcher(self._start.deep_copy())


class _LLGuidanceMatcher:
    def __init__(self, m):
        self.m = m

    def fill(self, bitmask: Tensor, row: int) -> None:
        v = bitmask[row]
        self.m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def advance(self, token: int) -> bool:
        return self.m.try_consume_tokens([int(token)]) == 1  # a refused token is not consumed

    def rollback(self, n: int) -> None:
        if n and not self.m.rollback(n):
            raise RuntimeError(f"llguidance could not roll back {n} tokens: {self.m.get_error()}")

    def can_end(self) -> bool:
        return self.m.is_accepting()

    def ended(self) -> bool:
        return self.m.is_stopped() and not self.m.is_error()

    def error(self) -> str:
        return self.m.get_error() if self.m.is_error() else ""


# ---- xgrammar (optional) ----------------------------------------------------------------------
class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        try:
            import xgrammar as xgr
        except ImportError as e:
            raise ConfigError(f"the xgrammar engine is not installed ({e}): pip install --no-deps xgrammar==0.2.9 "
                              "apache-tvm-ffi") from None
        self.vocab_size = int(vocab_size)
        self.mask_vocab = max(self.vocab_size, len(tokenizer))
        eos = sorted(int(e) for e in eos_token_ids) or None
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.mask_vocab, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)

    def compile(self, spec: GrammarSpec) -> "_XGrammarGrammar":
        c = self.compiler
        try:
            if spec.kind == "json_object":
                g = c.compile_json_schema(json.dumps({"type": "object"}))
            elif spec.kind == "json_schema":
                g = c.compile_json_schema(spec.source, strict_mode=spec.strict)
            elif spec.kind == "regex":
                g = c.compile_regex(spec.source)
            else:
                g = c.compile_grammar(spec.source)
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"response_format {spec.kind}: {e}") from None
        return _XGrammarGrammar(g, self.mask_vocab)


class _XGrammarGrammar:
    def __init__(self, compiled, mask_vocab: int):
        self.compiled, self.mask_vocab = compiled, mask_vocab

    def matcher(self) -> "_XGrammarMatcher":
        import xgrammar as xgr

        return _XGrammarMatcher(xgr.GrammarMatcher(self.compiled), self.compiled.tokenizer_info.stop_token_ids,
                                self.mask_vocab)


class _XGrammarMatcher:
    def __init__(self, m, stop_ids, vocab_size: int):
        self.m, self.stop_ids = m, [int(t) for t in stop_ids]
        self._probe = torch.zeros(1, mask_words(vocab_size), dtype=torch.int32)

    def fill(self, bitmask: Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def advance(self, token: int) -> bool:
        return self.m.accept_token(int(token))  # a refused token leaves the state as it was

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)

    def can_end(self) -> bool:
        return self.m.is_completed()

    def ended(self) -> bool:
        """No token but a stop token is allowed (xgrammar has no direct query for it: its mask is read)."""
        if self.m.is_terminated():
            return True
        if not self.m.is_completed():
            return False
        self.m.fill_next_token_bitmask(self._probe, 0)
        for t in self.stop_ids:
            bit = 1 << (t % 32)
            self._probe[0, t // 32] &= ~(bit - (1 << 32) if bit >= 1 << 31 else bit)  # as a signed int32
        return not bool(self._probe.any())

    def error(self) -> str:
        return ""
