"""The backend protocol: the one seam between the decoding loop and a model runtime.

A backend owns one model and its KV cache for one sequence; ``sibling()`` gives another
sequence's backend over the same model (its own cache, no copy of the weights), and
:func:`forward_batch` runs one pass for several sequences at once where the runtime can (one
concatenation of every sequence's rows through the weights; each sequence attends to its own
cache under its own mask). ``forward`` appends the given tokens
after the ``cache_length`` cached ones, with explicit positions and an optional tree mask whose
columns cover the last ``c`` cached entries and the ``n`` new ones (everything earlier is visible
to all new tokens: it is committed context), and returns logits (and, on request, the final normed hidden state, with
the states entering chosen layers beside it) for the rows asked for. Rollback and compaction act on the cache only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol, Sequence, runtime_checkable

import torch


class HiddenNeed(Enum):
    """Which final normed hidden states a pass returns besides the logits (``forward(want_hidden=)``),
    and what a drafter asks of the target (``Drafter.hidden_need``):

    NONE  no hidden state.
    LAST  the rows that get logits (``rows``), (m, H); for a drafter: the state of the last
          committed position, the one whose output is the next root.
    ALL   every new row of the pass, (n, H); for a drafter: the state of every committed position.
    """

    NONE = "none"
    LAST = "last"
    ALL = "all"


@dataclass(frozen=True)
class ForwardOut:
    logits: torch.Tensor  # (m, V) float32, one row per requested position
    # (m, W) with HiddenNeed.LAST, (n, W) with HiddenNeed.ALL, else None; W = H (1 + len(layers)): the
    # final normed state, then the residual stream entering each of the request's ``layers``
    hidden: torch.Tensor | None = None


class KVCacheLike(Protocol):
    length: int

    def rollback(self, length: int) -> None: ...

    def compact(self, start: int, keep: torch.Tensor) -> None: ...


class CacheBacked:
    """The cache half of the protocol for a backend whose ``self.cache`` (``runtime.kv_cache.KVCache`` or
    ``runtime.native_cache.StaticKVCache``) has ``length``, ``rollback`` and ``compact``."""

    cache: KVCacheLike
    shares_passes = False  # True: forward_many runs several sequences' rows through one pass

    @property
    def cache_length(self) -> int:
        return self.cache.length

    @staticmethod
    def forward_many(backends: Sequence["Backend"], requests: Sequence[ForwardRequest]) -> list[ForwardOut]:
        """Several sequences' requests (one backend each): one ``forward`` per sequence here; a
        runtime with ``shares_passes`` runs them as one pass."""
        return [b.forward(r.tokens, r.positions, r.tree_mask, r.rows, r.want_hidden, r.layers)
                for b, r in zip(backends, requests)]

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def compact(self, start: int, keep: torch.Tensor) -> None:
        self.cache.compact(start, keep)


@dataclass(frozen=True)
class ForwardRequest:
    """One sequence's part of a pass: ``Backend.forward``'s arguments (see there)."""
    tokens: torch.Tensor  # (n,) long
    positions: torch.Tensor | None = None  # (n,) long; None = cache_length + arange(n)
    tree_mask: torch.Tensor | None = None  # (n, c + n) bool; None = causal
    rows: torch.Tensor | None = None  # (m,) long; None = all n rows
    want_hidden: HiddenNeed = HiddenNeed.NONE
    # with want_hidden: the target layers (0-based) whose input states (the residual stream entering
    # them, unnormed) follow the final state in each hidden row (EAGLE-3's low- and mid-level features)
    layers: tuple[int, ...] = ()
    # True: rows whose results need not equal one-token passes bit for bit (a prompt, which every
    # method prefills alike; a draft model catching up), so a runtime may take its prefill
    # kernels for them. Verified and generated tokens never set it.
    prefill: bool = False


def forward_batch(backends: Sequence["Backend"], requests: Sequence[ForwardRequest]) -> list[ForwardOut]:
    """One pass of every ``requests[i]`` on ``backends[i]`` (distinct sequences of one model):
    through the backend class's ``forward_many`` when every backend is of one class and shares
    the model, else one ``forward`` per sequence. Returns one ForwardOut per request, in order; each
    is what ``forward`` alone would return for that sequence (bit for bit where the runtime's
    kernels are row-invariant)."""
    if len(backends) != len(requests):
        raise ValueError(f"{len(backends)} backends for {len(requests)} requests")
    if len({id(b) for b in backends}) != len(backends):
        raise ValueError("forward_batch needs one backend (one KV cache) per sequence")
    if not backends:
        return []
    first = backends[0]
    if all(type(b) is type(first) and b.model is first.model for b in backends):
        return type(first).forward_many(list(backends), list(requests))
    return [b.forward(r.tokens, r.positions, r.tree_mask, r.rows, r.want_hidden, r.layers)
            for b, r in zip(backends, requests)]


def check_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """``layers`` of a request as a tuple, each checked against the model's ``num_layers``."""
    out = tuple(int(i) for i in layers)
    bad = [i for i in out if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"hidden states entering layers {bad} were asked of a model of {num_layers} layers "
                         f"(0 .. {num_layers - 1})")
    return out


@runtime_checkable
class Backend(Protocol):
    name: str
    vocab_size: int  # logits dimension V

    @property
    def cache_length(self) -> int: ...

    def forward(
        self,
        tokens: torch.Tensor,  # (n,) long
        positions: torch.Tensor | None = None,  # (n,) long; None = cache_length + arange(n)
        tree_mask: torch.Tensor | None = None,  # (n, c + n) bool over the last c cached + n new; None = causal
        rows: torch.Tensor | None = None,  # (m,) which of the n rows need logits; None = all
        want_hidden: HiddenNeed = HiddenNeed.NONE,  # LAST: hidden of the `rows`; ALL: of all n rows
        layers: Sequence[int] = (),  # with want_hidden: also the states entering these layers (ForwardOut.hidden)
    ) -> ForwardOut: ...

    def rollback(self, length: int) -> None: ...

    def compact(self, start: int, keep: torch.Tensor) -> None: ...

    def reset(self) -> None: ...

    def sibling(self) -> "Backend":
        """A backend for another sequence over the same model: its own empty KV cache."""
        ...

    shares_passes: bool  # forward_many runs several sequences' rows through one pass (else one by one)

    @staticmethod
    def forward_many(backends: Sequence["Backend"], requests: Sequence[ForwardRequest]) -> list[ForwardOut]:
        """``requests[i]`` on ``backends[i]`` (one model, distinct caches), each what ``forward`` gives."""
        ...
