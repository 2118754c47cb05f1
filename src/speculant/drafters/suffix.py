"""Suffix matches (model-free drafting from what was already written): a suffix automaton over the
sequence so far (prompt and output), and a bounded store of the model's own earlier answers in
this process (:class:`AnswerStore`, shared by every generation of a decoder), each proposing the
tokens that followed an earlier occurrence of the longest suffix of the context found there.

Prompt lookup (``drafters.lookup``) matches the last 1-3 tokens; the automaton finds the longest
suffix of the whole context that occurred before, however long (SAM-Decoding, Hu et al. 2024,
matches a suffix automaton of the context and a corpus the same way), in amortized O(1) per
token. The answer store carries what the model wrote for earlier requests into later ones
(SuffixDecoding, Oliaro et al. 2024: suffix trees over earlier outputs), which pays where
requests repeat (agents' calls, regenerated answers, the same code asked for twice).

A suffix automaton (Blumer et al. 1985) of a text has one state per class of substrings with the
same set of end positions; ``link`` goes to the class of the longest shorter suffix that ends in
more places, ``length`` is the longest substring of a class. After appending a token, the link of
the whole text's state is the longest suffix that occurred earlier: the match, with no search.
Which earlier occurrence a match continues from: the latest one seen while matching (``seen``),
else the first (``first``); both are real occurrences, so the continuation is one the text had.

Deterministic, like prompt lookup: the target verifies every token, the output is unchanged.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..trees.buffers import chain
from ..trees.draft import Draft
from .base import HiddenNeed, ProposesAlone

__all__ = ["AnswerStore", "SuffixAutomaton", "SuffixDrafter", "SuffixMatcher"]

DEFAULT_STORE_TOKENS = 1 << 16  # the answer store's bound (tokens of earlier answers kept)


class SuffixAutomaton:
    """The suffix automaton of a token sequence, built online (``extend``). States are ints;
    ``text`` is the sequence (a separator between strings: any negative token, never matched)."""

    def __init__(self):
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.first: list[int] = [-1]  # the end position of the class's first occurrence
        self.seen: list[int] = [-1]  # an end position of a later occurrence (-1: none recorded)
        self.text: list[int] = []
        self.last = 0

    def __len__(self) -> int:
        return len(self.text)

    def _state(self, length: int, link: int, first: int, nxt: dict[int, int], seen: int = -1) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.first.append(first)
        self.seen.append(seen)
        return len(self.length) - 1

    def extend(self, t: int) -> None:
        """Append token ``t`` (the textbook construction, with clones keeping ``first``/``seen``)."""
        i = len(self.text)
        self.text.append(t)
        nxt, link, length = self.next, self.link, self.length
        cur = self._state(length[self.last] + 1, 0, i, {})
        p = self.last
        while p != -1 and t not in nxt[p]:
            nxt[p][t] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][t]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = self._state(length[p] + 1, link[q], self.first[q], dict(nxt[q]), self.seen[q])
                while p != -1 and nxt[p].get(t) == q:
                    nxt[p][t] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def earlier(self, state: int) -> int:
        """An end position of ``state``'s class before the text's end (the latest recorded)."""
        seen = self.seen[state]
        return seen if seen >= 0 else self.first[state]

    def continuation(self, end: int, n: int) -> list[int]:
        """Up to ``n`` tokens after position ``end``, stopping at a separator (negative token)."""
        out = []
        for t in self.text[end + 1:end + 1 + n]:
            if t < 0:
                break
            out.append(t)
        return out


class SuffixMatcher:
    """The longest suffix of one sequence's context (fed token by token) that occurs in another
    automaton's text (the answer store): ``state`` and ``length`` of the match. The automaton may
    grow meanwhile; what a stale state reaches is still an occurrence of the matched suffix."""

    def __init__(self, sam: SuffixAutomaton):
        self.sam, self.state, self.length = sam, 0, 0

    def feed(self, t: int) -> None:
        nxt, link, length = self.sam.next, self.sam.link, self.sam.length
        m, n = self.state, self.length
        while m != 0 and t not in nxt[m]:
            m = link[m]
            n = min(n, length[m])
        if t in nxt[m]:
            self.state, self.length = nxt[m][t], n + 1
        else:
            self.state, self.length = 0, 0


class AnswerStore:
    """The model's earlier answers in this process, one automaton over all of them (each closed by
    a separator), shared by a decoder's generations; at most ``max_tokens`` tokens: past that it
    is rebuilt from the newest answers that fill half of it (``version`` counts rebuilds, so
    matchers of the old automaton start over). Not thread-safe: one thread steps the sequences."""

    def __init__(self, max_tokens: int = DEFAULT_STORE_TOKENS):
        if max_tokens < 1:
            raise ConfigError(f"the answer store needs room for at least one token, got {max_tokens}")
        self.max_tokens = max_tokens
        self.sam = SuffixAutomaton()
        self.answers: list[list[int]] = []
        self.version = 0

    def __len__(self) -> int:
        return len(self.sam)

    def add(self, answer: list[int]) -> None:
        """Keep ``answer`` (token ids, >= 0); an empty one is ignored, a longer one than the bound cut."""
        answer = [int(t) for t in answer][-self.max_tokens + 1:] if answer else []
        if not answer:
            return
        if len(self.sam) + len(answer) + 1 > self.max_tokens:
            keep, size = [], 0
            for a in reversed(self.answers):
                if size + len(a) + 1 > self.max_tokens // 2:
                    break
                keep.append(a)
                size += len(a) + 1
            self.answers = keep[::-1]
            self.sam = SuffixAutomaton()
            self.version += 1
            for k, a in enumerate(self.answers):
                self._append(a, k)
        self.answers.append(answer)
        self._append(answer, len(self.answers) - 1)

    def _append(self, answer: list[int], k: int) -> None:
        for t in answer:
            self.sam.extend(t)
        self.sam.extend(-1 - k)  # a separator of its own: no match runs across two answers


class SuffixSource:
    """One sequence's suffix matches: its own automaton (prompt and output so far) and, with a
    store, a matcher over the earlier answers. ``sync(context)`` feeds what is new; ``best(n)``
    is the longer match's continuation of up to ``n`` tokens and the match's length."""

    RESYNC = 64  # context tokens re-fed to a matcher after the store was rebuilt

    def __init__(self, store: AnswerStore | None = None):
        self.store = store
        self.sam = SuffixAutomaton()
        self.matcher = SuffixMatcher(store.sam) if store is not None else None
        self._version = store.version if store is not None else 0

    def sync(self, context: list[int]) -> None:
        sam = self.sam
        if len(context) < len(sam):
            raise ValueError("the context is shorter than what the automaton has read: call begin first")
        store = self.store
        if store is not None and store.version != self._version:  # the store was rebuilt
            self.matcher, self._version = SuffixMatcher(store.sam), store.version
            for t in context[max(len(sam) - self.RESYNC, 0):len(sam)]:
                self.matcher.feed(t)
        for t in context[len(sam):]:
            sam.extend(t)
            if self.matcher is not None:
                self.matcher.feed(t)

    def best(self, n: int, min_length: int = 1) -> tuple[list[int], int]:
        """The continuation (<= n tokens, maybe empty) of the longest match of at least
        ``min_length`` tokens (the context's own first on a tie) and that match's length."""
        sam = self.sam
        own = sam.link[sam.last] if sam.last else 0
        own_len = sam.length[own] if own > 0 else 0
        other_len = self.matcher.length if self.matcher is not None else 0
        if max(own_len, other_len) < min_length:
            return [], 0
        if own_len >= other_len:
            end = sam.earlier(own)
            sam.seen[own] = len(sam) - 1  # the next time this class matches, continue from here
            return sam.continuation(end, n), own_len
        assert self.store is not None and self.matcher is not None  # other_len > own_len >= 0
        store = self.store.sam
        return store.continuation(store.earlier(self.matcher.state), n), other_len


class SuffixDrafter(ProposesAlone):
    """Proposes the continuation of the longest suffix match (:class:`SuffixSource`) as a chain of
    up to ``gamma`` tokens; with a ``sizer`` (``tuning.sizing.TreeSizer``) only the first c that
    pay, as prompt lookup's chain. ``store``: the decoder's answer store, or None; every finished
    answer is added to it (``finish``)."""

    hidden_need = HiddenNeed.NONE
    hidden_layers = ()

    def __init__(self, gamma: int = 8, store: AnswerStore | None = None, sizer=None, min_length: int = 1):
        if gamma < 1:
            raise ConfigError(f"suffix draft length gamma must be >= 1, got {gamma}")
        self.gamma, self.store, self.sizer, self.min_length = gamma, store, sizer, min_length
        self.source = SuffixSource(store)
        self._prompt_len = 0

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        self.source = SuffixSource(self.store)
        self._prompt_len = int(prompt.shape[0])
        self.source.sync(prompt.tolist())

    def propose(self, context: torch.Tensor) -> Draft:
        self.source.sync(context.tolist())
        cont, _ = self.source.best(self.gamma, self.min_length)
        if self.sizer is not None and cont:
            _, c = self.sizer.choose([], [], len(cont), context=int(context.shape[0]))
            cont = cont[:c]
            tokens = torch.tensor([int(context[-1])] + cont, dtype=torch.long)
            self.sizer.drafted(tokens, cont, [])
        else:
            tokens = torch.tensor([int(context[-1])] + cont, dtype=torch.long)
        return Draft(chain(len(cont)), tokens)

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None = None) -> None:
        if self.sizer is not None:
            self.sizer.observe(path)

    def finish(self, context: torch.Tensor) -> None:
        """The generation ended with ``context`` (L,): its answer goes to the store."""
        if self.store is not None:
            self.store.add(context[self._prompt_len:].tolist())
