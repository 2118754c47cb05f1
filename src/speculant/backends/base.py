"""The backend protocol: the one seam between the decoding loop and a model runtime.

A backend owns one model and its KV cache for one sequence. ``forward`` appends the given tokens
after the ``cache_length`` cached ones, with explicit positions and an optional tree mask whose
columns cover the last ``c`` cached entries and the ``n`` new ones (everything earlier is visible
to all new tokens: it is committed context), and returns logits (and, on request, the final normed hidden state) for the rows
asked for. Rollback and compaction act on the cache only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class ForwardOut:
    logits: torch.Tensor  # (m, V) float32, one row per requested position
    hidden: torch.Tensor | None = None  # (m, H) final normed hidden state, if requested ((n, H): want_hidden="all")


class KVCacheLike(Protocol):
    length: int

    def rollback(self, length: int) -> None: ...

    def compact(self, start: int, keep: torch.Tensor) -> None: ...


class CacheBacked:
    """The cache half of the protocol for a backend whose ``self.cache`` (``kv_cache.KVCache`` or
    ``native_cache.StaticKVCache``) has ``length``, ``rollback`` and ``compact``."""

    cache: KVCacheLike

    @property
    def cache_length(self) -> int:
        return self.cache.length

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def compact(self, start: int, keep: torch.Tensor) -> None:
        self.cache.compact(start, keep)


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
        want_hidden: bool | str = False,  # True: hidden of the `rows`; "all": of all n rows (logits: `rows`)
    ) -> ForwardOut: ...

    def rollback(self, length: int) -> None: ...

    def compact(self, start: int, keep: torch.Tensor) -> None: ...

    def reset(self) -> None: ...
