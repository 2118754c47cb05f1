"""The native backend's static KV cache: one preallocated slab for every layer.

    kv: (layers, 2, H_kv, capacity, D)      index 0 = keys, 1 = values
    length: int                              entries 0 .. length-1 are valid

Same semantics as ``runtime.kv_cache.KVCache`` (the transformers backend's cache):

    cache.length == 10                 committed context
    write 5 tree nodes                 length -> 15 (entries 10..14 are the tree)
    cache.compact(10, [0, 1, 3])       length -> 13: nodes 0, 1, 3 now at 10, 11, 12
    cache.rollback(11)                 length -> 11

Rolling back is setting ``length``; nothing is freed or zeroed. The slab doubles when a write
would overflow it (one copy, rare: the default capacity holds a few thousand tokens).
"""

from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 capacity: int = 1024):
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = num_layers, kv_heads, head_dim, dtype
        self.kv = torch.zeros(num_layers, 2, kv_heads, capacity, head_dim, dtype=dtype)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    @property
    def nbytes(self) -> int:
        """The slab's memory (all of its capacity, not only the valid entries)."""
        kv = self.kv
        return kv.numel() * kv.element_size()

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` entries (grows by doubling; keeps the valid entries)."""
        if needed <= self.capacity:
            return
        cap = max(needed, 2 * self.capacity)
        grown = torch.zeros(*self.kv.shape[:3], cap, self.head_dim, dtype=self.dtype)
        grown[:, :, :, :self.length] = self.kv[:, :, :, :self.length]
        self.kv = grown

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (H_kv, n, D) at start .. start+n-1 of ``layer``; return that layer's keys and
        values 0 .. start+n-1 as views (H_kv, start+n, D). ``length`` is advanced by the caller
        (once per forward, after every layer wrote: ``advance``)."""
        end = start + k.shape[1]
        slab = self.kv[layer]  # (2, H_kv, capacity, D)
        slab[0, :, start:end] = k
        slab[1, :, start:end] = v
        return slab[0, :, :end], slab[1, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def rollback(self, length: int) -> None:
        """Forget every entry at position >= length."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of length {self.length} to {length}")
        self.length = length

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep the entries ``start + keep`` (ascending, (m,) long) at ``start .. start+m-1``;
        drop everything after."""
        keep = keep.to(torch.long)
        m = keep.numel()
        if m and not torch.equal(keep, torch.arange(m)):  # an already-contiguous prefix needs no copy
            self.kv[:, :, :, start:start + m] = self.kv[:, :, :, start + keep]
        self.length = start + m

    def reset(self) -> None:
        self.length = 0
