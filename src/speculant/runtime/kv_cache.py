"""One explicit KV cache with rollback and compaction.

Every layer keeps preallocated key/value slabs of shape (1, H_kv, capacity, D) and a shared
``length``. Appending writes in place (the slab doubles when full); rolling back is setting
``length``; compaction copies the accepted tree nodes' entries into contiguous positions and drops
the rest. It plugs into transformers models as a ``Cache`` (the model calls ``update`` per layer),
so no model code is patched.

    cache.length == 10                 committed context
    forward(5 tree nodes)              length -> 15 (entries 10..14 are the tree)
    cache.compact(10, [0, 1, 3])       length -> 13: nodes 0, 1, 3 now at 10, 11, 12
    cache.rollback(11)                 length -> 11
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlabLayer(CacheLayerMixin):
    """One attention layer's keys and values in a growable preallocated slab."""

    is_compileable = False
    is_croppable = True

    def __init__(self, capacity: int = 256):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self._k: torch.Tensor | None = None  # (1, H_kv, capacity, D)
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        if b != 1:
            raise ValueError("speculant's KV cache holds one sequence (batch size 1)")
        self.dtype, self.device = key_states.dtype, key_states.device
        self._k = key_states.new_zeros(b, h, self.capacity, d)
        self._v = value_states.new_zeros(b, h, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def _reserve(self, needed: int) -> None:
        if needed <= self._k.shape[2]:
            return
        cap = max(needed, 2 * self._k.shape[2])

        def grow(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(*t.shape[:2], cap - t.shape[2], t.shape[3])], dim=2)

        self._k, self._v = grow(self._k), grow(self._v)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        end = self.length + n
        self._reserve(end)
        self._k[:, :, self.length:end] = key_states
        self._v[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, max_length: int) -> None:
        self.length = max_length if max_length >= 0 else max(self.length + max_length, 0)

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep entries start + keep[i] at start + i; drop everything after."""
        src = start + keep
        m = keep.numel()
        self._k[:, :, start:start + m] = self._k[:, :, src]
        self._v[:, :, start:start + m] = self._v[:, :, src]
        self.length = start + m

    def reset(self) -> None:
        self.length = 0


class KVCache(Cache):
    """The cache of one model for one sequence: ``length`` tokens are cached."""

    def __init__(self, num_layers: int, capacity: int = 256):
        super().__init__(layers=[SlabLayer(capacity) for _ in range(num_layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def nbytes(self) -> int:
        """The slabs' memory (their whole capacity; a layer that has seen no token has none yet)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer._k, layer._v)
                   if t is not None)

    def rollback(self, length: int) -> None:
        """Forget every entry at position >= length."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of length {self.length} to {length}")
        for layer in self.layers:
            layer.length = length

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep the entries ``start + keep`` (ascending, (m,) long) at ``start .. start+m-1``."""
        keep = keep.to(torch.long)
        for layer in self.layers:
            if layer.is_initialized:
                layer.compact(start, keep)
            else:
                layer.length = start + keep.numel()
