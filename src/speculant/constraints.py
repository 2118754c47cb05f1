"""Constrained decoding (``response_format``), exact under speculation.

A request may ask for output that matches a grammar: OpenAI's ``response_format``
``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {...}}``, or this
library's extensions ``{"type": "regex", "regex": ...}`` and ``{"type": "grammar", "grammar":
<Lark or GBNF>}``. The distribution decoding must reproduce is then the *masked* target
distribution: at every position, p restricted to the tokens the grammar allows after the text so
far, renormalised. Under speculation the row of tree node i (the target's output after node i) is
masked with the grammar state after node i's own path — the committed state advanced by the
drafted tokens from the root to node i. :meth:`Constraint.mask_tree` visits the tree depth-first
from the committed state (advance, fill the row's bitmask, roll back), so each row gets exactly
the mask a one-token step gives once that path is committed; the acceptance rule then runs on
the masked rows unchanged: greedy matching against the masked argmax, speculative sampling
against the masked, renormalised p. The draft's q needs no mask for exactness (a drafted token
the grammar refuses has p = 0 and is always rejected); a draft model's q is masked too
(:meth:`Constraint.mask_nodes`), which only raises acceptance. After acceptance the committed
state advances by the committed tokens (:meth:`Constraint.commit`).

The end of the text:

* an EOS token is allowed exactly where the grammar may end (the text so far is a complete
  match): the model may stop there, ``finish_reason`` "eos";
* where the grammar allows nothing more, the generation ends right after the token that completed
  it, without spending a pass on a forced EOS: ``finish_reason`` "stop" (as for a stop string:
  the request's own rule ended it; OpenAI reports both as "stop"). The EOS token is not part of
  the output then.

Rows past the grammar's end are left as they are (the step is cut there), and so is a row whose
mask allows nothing (an engine failure: committing any token there raises :class:`GrammarError`).
Log-probabilities (``logprobs``) stay the raw target's, as with penalties.

Shapes: N tree nodes (node 0 the root, the last committed token), V vocabulary, W = ceil(V / 32)
int32 words per bitmask row.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
from torch import Tensor

from .errors import ConfigError, SpeculantError
from .grammars import CompiledGrammar, GrammarSpec, Matcher, mask_words
from .trees.buffers import TreeBuffers

__all__ = ["DEFAULT_ENGINE", "RESPONSE_FORMAT_TYPES", "Constraint", "GrammarError", "parse_response_format",
           "unpack_bitmask"]

# the engine the decoder compiles grammars with (grammars.ENGINES); why: docs/design-notes.md#grammar-engine
DEFAULT_ENGINE = "llguidance"
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
_KEYS = {"text": set(), "json_object": set(), "json_schema": {"json_schema"}, "regex": {"regex"},
         "grammar": {"grammar"}}
_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

# (256, 8) bool: bit k of byte value b
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()


class GrammarError(SpeculantError):
    """The grammar engine failed mid-generation (or a token it refuses was about to be committed)."""


def parse_response_format(response_format: Any) -> GrammarSpec | None:
    """``response_format`` (OpenAI's shapes plus ``regex`` and ``grammar``) as a GrammarSpec, or
    None for plain text. A bad shape raises ConfigError naming what is wrong.

    ``json_schema`` takes ``{"name": ^[A-Za-z0-9_-]{1,64}$, "schema": {...}, "strict": bool,
    "description": str}`` (name and schema required). Strict: every keyword of the schema is
    enforced, and a schema using one the engine does not implement is refused; not strict (OpenAI's
    default), such keywords are ignored and the rest is still enforced."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ConfigError(f"response_format must be an object with a \"type\" ({', '.join(RESPONSE_FORMAT_TYPES)}), "
                          f"got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        got = "no \"type\"" if "type" not in response_format else f"{kind!r}"
        raise ConfigError(f"response_format type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {got}")
    extra = sorted(set(response_format) - {"type"} - _KEYS[kind])
    if extra:
        takes = f"only {', '.join(sorted(_KEYS[kind]))} besides type" if _KEYS[kind] else "nothing besides type"
        raise ConfigError(f"response_format of type {kind!r} takes {takes}; unknown key(s): "
                          f"{', '.join(map(str, extra))}")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        return _json_schema(response_format.get("json_schema"))
    value = response_format.get(kind)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"response_format of type {kind!r} needs a non-empty string {kind!r}, got "
                          f"{'nothing' if value is None else repr(value) if value == '' else type(value).__name__}")
    if "\x00" in value:
        raise ConfigError(f"response_format {kind} contains a NUL character")
    return GrammarSpec(kind, value)


def _json_schema(spec: Any) -> GrammarSpec:
    if not isinstance(spec, dict):
        raise ConfigError("response_format of type 'json_schema' needs \"json_schema\": an object with \"name\" and "
                          f"\"schema\", got {'nothing' if spec is None else type(spec).__name__}")
    extra = sorted(set(spec) - _SCHEMA_KEYS)
    if extra:
        raise ConfigError(f"response_format json_schema takes name, schema, strict and description; unknown key(s): "
                          f"{', '.join(map(str, extra))}")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError("response_format json_schema needs a \"name\" of 1 to 64 letters, digits, '_' or '-', got "
                          f"{'nothing' if name is None else repr(name)}")
    if "description" in spec and not isinstance(spec["description"], str):
        raise ConfigError("response_format json_schema \"description\" must be a string")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ConfigError(f"response_format json_schema \"strict\" must be true, false or null, got {strict!r}")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ConfigError("response_format json_schema needs a \"schema\": a JSON Schema object, got "
                          f"{'nothing' if schema is None else type(schema).__name__}")
    try:
        text = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"response_format json_schema \"schema\" is not JSON: {e}") from None
    return GrammarSpec("json_schema", text, strict=bool(strict))


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """int32 bitmask (n, W) -> bool (n, V): token t allowed iff bit t % 32 of word t // 32 is set
    (the words read as little-endian bytes, as x86 stores them)."""
    n = bitmask.shape[0]
    return _BYTE_BITS[bitmask.contiguous().view(torch.uint8).long()].view(n, -1)[:, :vocab_size]


class Constraint:
    """One generation's grammar state and the masks it puts on the target's (and draft's) rows.
    ``matcher``: the committed state (at the grammar's start); ``vocab_size``: V of the rows
    masked; ``eos_token_ids``: allowed exactly where the grammar may end; ``mask_vocab``: the
    tokens the engine's bitmask rows cover (>= V; default V)."""

    def __init__(self, matcher: Matcher, vocab_size: int, eos_token_ids=frozenset(), mask_vocab: int | None = None):
        self.matcher = matcher
        self.V = int(vocab_size)
        self.words = mask_words(max(self.V, int(mask_vocab or 0)))
        self.eos = frozenset(int(e) for e in eos_token_ids if 0 <= int(e) < self.V)
        self._eos_cols = torch.tensor(sorted(self.eos), dtype=torch.long)

    @classmethod
    def start(cls, grammar: CompiledGrammar, vocab_size: int, eos_token_ids=frozenset()) -> "Constraint":
        return cls(grammar.matcher(), vocab_size, eos_token_ids, grammar.mask_vocab)

    @property
    def ended(self) -> bool:
        """The committed text allows nothing more."""
        return self.matcher.ended()

    def mask_tree(self, logits: Tensor, tree: TreeBuffers, tokens: Tensor) -> Tensor:
        """The masked rows of a verification pass: ``logits`` (N, V) the target's rows for the
        tree's nodes, ``tokens`` (N,) long the drafted tree (−1: unfilled). Row i gets the mask of
        the state after node i's path; a node whose token the grammar refuses at its parent is never
        entered (its row, and its subtree's, stay as they are: p of that token is 0, so no path
        through it is accepted). Returns float32 (N, V); the committed state is unchanged."""
        N, V = logits.shape
        bits = torch.zeros(N, self.words, dtype=torch.int32)
        filled, can_end = [], []
        kids, toks = tree.children.tolist(), tokens.tolist()
        m = self.matcher

        def visit(i: int) -> None:
            if m.ended():  # the step is cut here
                return
            m.fill(bits, i)
            filled.append(i)
            can_end.append(m.can_end())
            for c in kids[i]:
                t = toks[c] if c >= 0 else -1
                if t < 0 or t >= V or t in self.eos:
                    continue
                if (int(bits[i, t >> 5]) >> (t & 31)) & 1 and m.advance(t):  # allowed here: enter it
                    visit(c)
                    m.rollback(1)

        visit(0)
        return self._apply(logits, bits, filled, can_end)

    def allowed_prefix(self, tree: TreeBuffers, tokens: Tensor) -> int:
        """How many of the drafted tree's first nodes (breadth-first, ``tokens`` (N,) long) the
        grammar allows, each after its own path: the draft can be cut there before it is verified
        (a refused node and its subtree could never be accepted; a chain is cut at its first
        refused token). The committed state is unchanged."""
        kids, toks = tree.children.tolist(), tokens.tolist()
        entered = [False] * tree.size
        m = self.matcher

        def visit(i: int) -> None:
            entered[i] = True
            if m.ended():
                return
            for c in kids[i]:
                t = toks[c] if c >= 0 else -1
                if 0 <= t < self.V and t not in self.eos and m.advance(t):
                    visit(c)
                    m.rollback(1)

        visit(0)
        return entered.index(False) if False in entered else tree.size

    def mask_nodes(self, logits: Tensor, tree: TreeBuffers, tokens: Tensor, nodes: Tensor) -> Tensor:
        """Draft side: ``logits`` (m, V) the draft's rows at tree nodes ``nodes`` (m,), each masked
        with the state after its path (of ``tokens`` (N,), filled down to those nodes); a node on a
        path the grammar refuses keeps its row. Returns float32 (m, V)."""
        m, V = logits.shape
        bits = torch.zeros(m, self.words, dtype=torch.int32)
        parents, toks = tree.parents.tolist(), tokens.tolist()
        filled, can_end = [], []
        g = self.matcher
        for r, node in enumerate(nodes.tolist()):
            path, j = [], node
            while j > 0:
                path.append(toks[j])
                j = parents[j]
            done = 0
            for t in reversed(path):
                if t < 0 or t >= V or t in self.eos or not g.advance(t):
                    break
                done += 1
            if done == len(path) and not g.ended():
                g.fill(bits, r)
                filled.append(r)
                can_end.append(g.can_end())
            g.rollback(done)
        return self._apply(logits, bits, filled, can_end)

    def _apply(self, logits: Tensor, bits: Tensor, filled: list[int], can_end: list[bool]) -> Tensor:
        """``logits`` (n, V) float32 with rows ``filled`` masked by their ``bits`` rows, EOS allowed
        where ``can_end``; a row whose mask allows nothing stays as it is."""
        out = logits.float()
        if not filled:
            return out
        V = logits.shape[1]
        rows = torch.tensor(filled, dtype=torch.long)
        allowed = unpack_bitmask(bits[rows], V)  # (f, V)
        if self._eos_cols.numel():
            eos = self._eos_cols[self._eos_cols < V]
            allowed[:, eos] = torch.tensor(can_end)[:, None]
        keep = allowed.any(-1)  # (f,) a row allowing nothing is an engine failure: see commit
        rows, allowed = rows[keep], allowed[keep]
        out = out.clone() if out is logits else out
        out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
        return out

    def commit(self, new: list[int], reason: str | None) -> tuple[list[int], str | None]:
        """Advance the committed state by a step's ``new`` tokens (already cut by the stopping
        rule, which ended it for ``reason`` or not): the tokens kept and the finish reason —
        "stop" once the grammar allows nothing more (the rest cut), else ``reason``."""
        m = self.matcher
        for i, t in enumerate(new):
            if m.ended():
                return new[:i], "stop"
            if t in self.eos:  # the stopping rule cut the step here ("eos")
                return new[:i + 1], reason
            if not m.advance(t):
                why = m.error() or f"token {t} is not allowed by the grammar here"
                raise GrammarError(f"constrained decoding failed after {i} tokens of this step: {why}")
        return (new, "stop") if m.ended() else (new, reason)
