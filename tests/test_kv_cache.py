"""The explicit KV cache: append, growth, rollback and compaction, against full recomputation."""

import torch

from speculant.backends.hf import HFBackend
from speculant.runtime.kv_cache import KVCache
from speculant.trees.buffers import build_tree

from tiny import tiny_llama


def full_logits(model, ids):
    with torch.no_grad():
        return model(ids.view(1, -1)).logits[0]


def test_tree_verification_equals_sequential_and_compaction_keeps_path():
    model = tiny_llama(0)
    be = HFBackend(model)
    ids = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(0))
    be.forward(ids[:8])
    t = build_tree([[0], [1], [0, 0], [0, 1]])
    toks = torch.tensor([ids[8], ids[9], 5, ids[10], 7])  # path 0 -> 1 -> 3 follows ids
    out = be.forward(toks, 8 + t.depths, t.mask)
    ref = full_logits(model, ids[:11])
    for node, pos in [(0, 8), (1, 9), (3, 10)]:
        torch.testing.assert_close(out.logits[node], ref[pos], atol=1e-5, rtol=1e-5)
    # a wrong branch is scored as its own sequence
    alt = full_logits(model, torch.cat([ids[:9], torch.tensor([5])]))
    torch.testing.assert_close(out.logits[2], alt[-1], atol=1e-5, rtol=1e-5)
    be.compact(8, torch.tensor([0, 1, 3]))
    assert be.cache_length == 11
    out = be.forward(ids[11:])  # grows the slabs beyond their initial capacity (256)
    torch.testing.assert_close(out.logits, full_logits(model, ids)[11:], atol=1e-4, rtol=1e-4)
    assert be.cache_length == 300


def test_rollback_then_recompute():
    model = tiny_llama(1)
    be = HFBackend(model)
    ids = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(1))
    be.forward(ids[:15])
    be.rollback(10)
    assert be.cache_length == 10
    out = be.forward(ids[10:12], rows=torch.tensor([1]))
    torch.testing.assert_close(out.logits[0], full_logits(model, ids[:12])[-1], atol=1e-5, rtol=1e-5)


def test_cache_unit_operations():
    cache = KVCache(num_layers=2, capacity=4)
    k = torch.arange(6.).view(1, 1, 6, 1)
    for layer in range(2):
        keys, _ = cache.update(k, k, layer)
        assert keys.shape[2] == 6
    assert cache.length == 6 and cache.get_seq_length() == 6
    cache.compact(2, torch.tensor([1, 3]))
    assert cache.length == 4
    assert cache.layers[0].keys is not None
    keys, _ = cache.update(torch.tensor([[[[9.]]]]), torch.tensor([[[[9.]]]]), 0)
    assert keys.flatten().tolist() == [0, 1, 3, 5, 9]
    cache.rollback(1)
    assert cache.length == 1
