"""A prefix cache across requests: token prefixes -> KV blocks of the native runtime's cache.

Chat front ends, editors and agents send the whole conversation again on every turn; what they
send again starts the same way (the system prompt, the tool definitions, earlier turns, the last
answer). A :class:`PrefixCache` keeps the keys and values a sequence computed, in blocks of
``block`` tokens, so that the next request that starts with the same tokens copies them into its
own cache and prefills only the rest.

Blocks are keyed as vLLM hashes full blocks with their prefix: a block's key is (its parent
block's serial number, its ``block`` token ids); a serial number names one block, which holds one
prefix, so equal keys mean equal prefixes (the tuple is compared whole: no hash collision can
return another prefix's entries, and a key costs the same to hash at any depth). Blocks form a tree; two requests
that share a system prompt share its blocks. Only full blocks are kept (the last partial block of
a prefix is recomputed: at most ``block - 1`` tokens).

Layout of one block (the native cache's slab, ``runtime.native_cache``, cut to ``block`` positions):

    kv:       (layers, 2, H_kv, block, D)    keys (0) and values (1) at the block's positions
    features: (block, W) or None             what a drafter keeps per position (the EAGLE
                                             drafter's target states), in the block's order

A match copies the blocks into the requester's own cache (``restore``): the running sequence owns
its copy, so eviction never touches a sequence in flight, and a sequence's later writes (its tree
rows, its answer) never touch the cache. Memory: the blocks' bytes never exceed ``budget_bytes``;
inserting past it evicts the least recently used blocks that no other block extends (LRU leaves),
and a block that cannot fit is not kept.

A cached prefix gives the next request the bits a cold prefill would give only where prefill and
decoding compute every row alike (row-invariant kernels, no widened prefill kernel, no prompt
attention of its own: ``SPECULANT_EXACT_PREFILL=1`` on the native runtime).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Hashable

import torch

from .native_cache import StaticKVCache

__all__ = ["PrefixCache", "PrefixHit"]


@dataclass(eq=False)
class _Block:
    key: Hashable  # (parent's serial number or -1, tokens)
    serial: int  # this block's number, unique for the cache's lifetime
    parent: "_Block | None"
    kv: torch.Tensor  # (layers, 2, H_kv, block, D)
    features: torch.Tensor | None  # (block, W)
    children: int = 0
    used: int = 0  # the cache's clock at its last match or insert

    @property
    def nbytes(self) -> int:
        f = self.features
        return self.kv.numel() * self.kv.element_size() + (0 if f is None else f.numel() * f.element_size())


@dataclass(frozen=True)
class PrefixHit:
    """A match: the first ``tokens`` token ids of the request are cached in ``blocks`` (in order)."""
    tokens: int
    blocks: tuple[_Block, ...] = field(default=(), repr=False)

    def features(self) -> torch.Tensor | None:
        """The matched positions' drafter features (tokens, W), or None (none kept, or no match)."""
        if not self.blocks or any(b.features is None for b in self.blocks):
            return None
        return torch.cat([b.features for b in self.blocks])


class PrefixCache:
    """Token prefixes -> KV blocks (module doc). ``budget_bytes``: the most memory its blocks take
    (0: keep nothing); ``block``: tokens per block. Not thread-safe: the decoding worker owns it."""

    def __init__(self, budget_bytes: int, block: int = 16):
        if budget_bytes < 0:
            raise ValueError(f"the prefix cache's budget must be >= 0 bytes, got {budget_bytes}")
        if block < 1:
            raise ValueError(f"a prefix cache block holds >= 1 token, got {block}")
        self.budget_bytes, self.block = int(budget_bytes), int(block)
        self._blocks: dict[Hashable, _Block] = {}
        self._clock = 0
        self._serials = itertools.count()
        self.bytes = 0  # in use by blocks
        self.hits = self.misses = self.evictions = 0
        self.tokens_reused = 0  # request tokens served from the cache (restore)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def tokens(self) -> int:
        """Token positions held (blocks x block)."""
        return len(self._blocks) * self.block

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def match(self, ids: torch.Tensor, limit: int | None = None, features: bool = False) -> PrefixHit:
        """The longest cached prefix of ``ids`` (T,) long, in whole blocks, of at most ``limit``
        tokens (default: all of ``ids``); ``features``: only blocks that keep drafter features
        count (a drafter that needs them cannot start from blocks without)."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        limit = len(ids) if limit is None else min(limit, len(ids))
        found: list[_Block] = []
        parent = -1
        now = self._tick()
        for start in range(0, limit - self.block + 1, self.block):
            blk = self._blocks.get((parent, tuple(ids[start:start + self.block])))
            if blk is None or (features and blk.features is None):
                break
            blk.used = now
            found.append(blk)
            parent = blk.serial
        if found:
            self.hits += 1
        else:
            self.misses += 1
        return PrefixHit(len(found) * self.block, tuple(found))

    def restore(self, hit: PrefixHit, cache: StaticKVCache) -> None:
        """Copy ``hit``'s blocks into ``cache`` (emptied first) at positions 0 .. hit.tokens-1."""
        cache.reset()
        if not hit.tokens:
            return
        cache.reserve(hit.tokens)
        b = self.block
        for i, blk in enumerate(hit.blocks):
            cache.kv[:, :, :, i * b:(i + 1) * b] = blk.kv
        cache.advance(hit.tokens)
        self.tokens_reused += hit.tokens

    def insert(self, ids: torch.Tensor, cache: StaticKVCache, features: torch.Tensor | None = None) -> int:
        """Keep the full blocks of ``ids`` (T,) long whose entries ``cache`` holds (its first
        ``min(T, cache.length)`` positions are the entries of ``ids``' tokens), with ``features``
        (>= that many rows, (n, W)) where given. Blocks already cached are not copied again.
        Returns the tokens now cached for this prefix."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        n = min(len(ids), cache.length)
        if features is not None:
            n = min(n, features.shape[0])
        parent: _Block | None = None
        now, b, done = self._tick(), self.block, 0
        for start in range(0, n - b + 1, b):
            key = (-1 if parent is None else parent.serial, tuple(ids[start:start + b]))
            blk = self._blocks.get(key)
            if blk is None:
                kv = cache.kv[:, :, :, start:start + b].clone()
                feats = None if features is None else features[start:start + b].clone()
                blk = _Block(key, next(self._serials), parent, kv, feats)
                if not self._make_room(blk.nbytes, keep=parent):
                    break
                self._blocks[key] = blk
                self.bytes += blk.nbytes
                if parent is not None:
                    parent.children += 1
            elif blk.features is None and features is not None:  # the same entries, now with features
                feats = features[start:start + b].clone()
                if not self._make_room(feats.numel() * feats.element_size(), keep=blk):
                    break
                self.bytes -= blk.nbytes
                blk.features = feats
                self.bytes += blk.nbytes
            blk.used = now
            parent, done = blk, start + b
        return done

    def _make_room(self, nbytes: int, keep: _Block | None) -> bool:
        """Evict LRU leaves until ``nbytes`` more fit in the budget; ``keep`` and its ancestors
        (the prefix being extended) are never evicted. False: it cannot fit."""
        if nbytes > self.budget_bytes:
            return False
        if self.bytes + nbytes <= self.budget_bytes:
            return True
        protected = set()
        while keep is not None:
            protected.add(keep.serial)
            keep = keep.parent
        leaves = [(blk.used, blk.serial, blk) for blk in self._blocks.values()
                  if blk.children == 0 and blk.serial not in protected]
        heapq.heapify(leaves)
        while self.bytes + nbytes > self.budget_bytes:
            if not leaves:
                return False
            *_, blk = heapq.heappop(leaves)
            self._evict(blk)
            up = blk.parent  # a parent whose last child went is a leaf now
            if up is not None and up.children == 0 and up.serial not in protected:
                heapq.heappush(leaves, (up.used, up.serial, up))
        return True

    def _evict(self, blk: _Block) -> None:
        del self._blocks[blk.key]
        self.bytes -= blk.nbytes
        self.evictions += 1
        if blk.parent is not None:
            blk.parent.children -= 1

    def clear(self) -> None:
        """Forget every block."""
        self._blocks.clear()
        self.bytes = 0
