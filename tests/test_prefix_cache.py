"""The prefix cache (runtime.prefix_cache): blocks shared by prefixes, restored bit for bit, a
memory budget that holds under random insertions, and a continuation from a cached prefix that
gives the logits of a cold pass."""

from __future__ import annotations

import random

import pytest
import torch

from speculant.backends.native import NativeBackend
from speculant.runtime.native_cache import StaticKVCache
from speculant.runtime.prefix_cache import PrefixCache

from tiny import tiny_qwen2

L, HKV, D = 2, 2, 4


def filled(ids: list[int], seed: int = 0) -> StaticKVCache:
    """A cache whose entry at position i is a function of ids[:i + 1] only (as a model's are)."""
    cache = StaticKVCache(L, HKV, D, torch.float32, capacity=8)
    cache.reserve(len(ids))
    for i in range(len(ids)):
        g = torch.Generator().manual_seed(hash((seed, tuple(ids[:i + 1]))) % (2 ** 31))
        cache.kv[:, :, :, i] = torch.randn(L, 2, HKV, D, generator=g)
    cache.advance(len(ids))
    return cache


def block_bytes(block: int, width: int = 0) -> int:
    return L * 2 * HKV * block * D * 4 + block * width * 4


def test_match_restores_the_inserted_entries_in_whole_blocks():
    ids = list(range(100, 150))  # 50 tokens: 3 blocks of 16, 2 tokens left over
    pc = PrefixCache(10 ** 7, block=16)
    src = filled(ids)
    assert pc.insert(torch.tensor(ids), src) == 48
    assert len(pc) == 3 and pc.bytes == 3 * block_bytes(16)
    hit = pc.match(torch.tensor(ids + [7, 8, 9]))
    assert hit.tokens == 48
    dst = StaticKVCache(L, HKV, D, torch.float32, capacity=4)
    dst.advance(0)
    pc.restore(hit, dst)
    assert dst.length == 48 and torch.equal(dst.kv[:, :, :, :48], src.kv[:, :, :, :48])
    assert pc.match(torch.tensor(ids), limit=47).tokens == 32  # a limit cuts to whole blocks
    assert pc.match(torch.tensor([1] + ids)).tokens == 0  # another first token: no match
    other = ids[:20] + [999] + ids[21:]  # differs inside the second block
    assert pc.match(torch.tensor(other)).tokens == 16


def test_two_prefixes_share_their_common_blocks():
    system = list(range(200, 232))  # two blocks
    a, b = system + list(range(10, 26)), system + list(range(30, 46))
    pc = PrefixCache(10 ** 7, block=16)
    pc.insert(torch.tensor(a), filled(a))
    pc.insert(torch.tensor(b), filled(b))
    assert len(pc) == 4  # the system prompt's two blocks once, then one block each
    assert pc.match(torch.tensor(a)).tokens == 48 and pc.match(torch.tensor(b)).tokens == 48
    hit_a, hit_b = pc.match(torch.tensor(a)), pc.match(torch.tensor(b))
    assert hit_a.blocks[:2] == hit_b.blocks[:2] and hit_a.blocks[2] is not hit_b.blocks[2]


def test_features_are_kept_beside_the_entries_and_required_where_asked():
    ids = list(range(40))
    pc = PrefixCache(10 ** 7, block=8)
    pc.insert(torch.tensor(ids), filled(ids))  # no features
    assert pc.match(torch.tensor(ids), features=True).tokens == 0
    feats = torch.randn(40, 3)
    pc.insert(torch.tensor(ids), filled(ids), feats[:20])  # features for 20 positions: 2 blocks get them
    hit = pc.match(torch.tensor(ids), features=True)
    assert hit.tokens == 16 and torch.equal(hit.features(), feats[:16])
    assert pc.bytes == 5 * block_bytes(8) + 16 * 3 * 4


def test_the_budget_holds_and_the_least_recently_used_leaves_go_first():
    rng = random.Random(0)
    budget = 7 * block_bytes(8)
    pc = PrefixCache(budget, block=8)
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 60))] for _ in range(200)]
    for ids in prefixes:
        pc.insert(torch.tensor(ids), filled(ids))
        assert pc.bytes <= budget and pc.bytes == len(pc) * block_bytes(8)
        # every block kept is reachable from the root, and restores what the prefix computed
        hit = pc.match(torch.tensor(ids))
        dst = StaticKVCache(L, HKV, D, torch.float32)
        pc.restore(hit, dst)
        assert torch.equal(dst.kv[:, :, :, :hit.tokens], filled(ids).kv[:, :, :, :hit.tokens])
    assert pc.evictions > 0
    # LRU: a prefix used again survives newer insertions that push others out
    keep = list(range(100, 116))
    pc2 = PrefixCache(3 * block_bytes(8), block=8)
    pc2.insert(torch.tensor(keep), filled(keep))  # 2 blocks
    for i in range(5):
        pc2.match(torch.tensor(keep))
        other = [300 + i] * 8
        pc2.insert(torch.tensor(other), filled(other))
    assert pc2.match(torch.tensor(keep)).tokens == 16 and pc2.bytes <= 3 * block_bytes(8)


def test_a_zero_budget_keeps_nothing_and_bad_settings_are_refused():
    pc = PrefixCache(0)
    ids = list(range(64))
    assert pc.insert(torch.tensor(ids), filled(ids)) == 0 and len(pc) == 0
    with pytest.raises(ValueError, match="budget"):
        PrefixCache(-1)
    with pytest.raises(ValueError, match="block"):
        PrefixCache(100, block=0)


def test_a_continuation_from_a_cached_prefix_gives_the_cold_logits():
    """A second request that starts with the first's tokens: its KV copied from the cache, the rest
    computed, gives bit for bit the logits of the same tokens computed from an empty cache (passes
    of up to 64 rows are row-invariant on the native runtime)."""
    model = tiny_qwen2(seed=0, scale=4.0)
    g = torch.Generator().manual_seed(1)
    first = torch.randint(0, 64, (40,), generator=g)
    second = torch.cat([first, torch.randint(0, 64, (12,), generator=g)])
    pc = PrefixCache(10 ** 8, block=16)
    seq = NativeBackend(model)
    with torch.inference_mode():
        seq.forward(first)
        assert pc.insert(first, seq.cache) == 32
        cold = NativeBackend(model).forward(second).logits[32:]
        seq.reset()
        hit = pc.match(second)
        assert hit.tokens == 32
        pc.restore(hit, seq.cache)
        warm = seq.forward(second[32:]).logits
    assert torch.equal(warm, cold)
    assert pc.tokens_reused == 32
