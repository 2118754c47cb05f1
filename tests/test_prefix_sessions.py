"""The prefix cache under the decoder (``SpeculativeDecoder.prefix_cache``): multi-turn sessions in
which every turn sends the whole history give, from the cache, token for token the answers the
same requests get cold (a decoder without a cache), on the exact path (``SPECULANT_EXACT_PREFILL=1``:
the prompt on the decoding kernels, so a prefill's rows and a step's rows are computed alike):
plain decoding, prompt lookup and the EAGLE drafter (whose target features are cached beside
the KV entries), random interleavings of sessions under a budget that forces evictions, batch
members, two sessions sharing a system prompt, and generations cancelled before and after
their prefill."""

from __future__ import annotations

import random

import pytest
import torch

from speculant.api import SpeculativeDecoder
from speculant.batching import Batch
from speculant.runtime.prefix_cache import PrefixCache
from speculant.tuning.costmodel import PassCost

from tiny import tiny_model_dir, tiny_qwen2

FLAT = PassCost((1, 64), (100.0, 100.0))  # a pass costs the same at any width: no measuring in tests
V = 64


@pytest.fixture(autouse=True)
def exact_prefill(monkeypatch):
    monkeypatch.setenv("SPECULANT_EXACT_PREFILL", "1")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from speculant.eagle.checkpoint import save_eagle
    from test_eagle import eagle_for

    from speculant.kernels import x86_kernels

    if x86_kernels() is None:
        pytest.skip("speculant's x86 kernels are not built on this machine: no row-invariant bf16 path to compare on")
    root = tmp_path_factory.mktemp("prefix")
    target = tiny_model_dir(root / "target", base=tiny_qwen2(0, scale=4.0))
    eagle = save_eagle(eagle_for(AutoModelForCausalLM.from_pretrained(target)), root / "eagle")
    return {"target": target, "eagle": eagle}


def decoder(dirs, method: str, cache: bool) -> SpeculativeDecoder:
    """bf16 on speculant's kernels: every row computed alike at any width (in float32 a pass of
    more than 64 rows takes one PyTorch call, which is not row-invariant)."""
    options = {"heads": dirs["eagle"]} if method == "eagle" else {}
    return SpeculativeDecoder(dirs["target"], method=method, backend="native", dtype="bfloat16", tree_budget=FLAT,
                              pacing=False, cache_ram=None if cache else 0, **options)


def ids(rng: random.Random, n: int) -> list[int]:
    """n token ids of a repetitive text (so lookup finds drafts), no special tokens."""
    base = [rng.randrange(4, V) for _ in range(7)]
    return [base[i % 7] if rng.random() < 0.6 else rng.randrange(4, V) for i in range(n)]


def play(dec, turns: list[list[int]], new: int = 24, history: list[int] | None = None):
    """A session: each turn's prompt is the history so far (every earlier prompt part and answer)
    and the turn's own tokens. Yields (prompt, result) per turn."""
    history = list(history or [])
    for part in turns:
        prompt = history + part
        res = dec.start(prompt, new, logprobs=2).result()
        yield prompt, res
        history = prompt + res.token_ids


@pytest.mark.parametrize("method", ["ar", "lookup", "eagle"])
def test_later_turns_come_from_the_cache_and_are_the_cold_answers(dirs, method):
    rng = random.Random(1)
    turns = [ids(rng, 120), ids(rng, 20), ids(rng, 9)]
    warm, cold = decoder(dirs, method, True), decoder(dirs, method, False)
    assert cold.prefix_cache is None and warm.prefix_cache is not None
    for n, (prompt, res) in enumerate(play(warm, turns)):
        want = cold.start(prompt, 24, logprobs=2).result()
        # the same tokens, and the same bits: each token's log-probability and the top two
        assert res.token_ids == want.token_ids and res.logprobs == want.logprobs, (method, n)
        # and the same drafts (the EAGLE drafter's from the cached target features): the same acceptances
        assert res.stats.accepted_per_call == want.stats.accepted_per_call, (method, n)
        cached = res.stats.cached_tokens
        assert cached % 16 == 0 and cached <= len(prompt) - 2
        if n:  # the history (the last prompt and its answer) was cached, whole blocks of it
            assert cached >= len(prompt) - len(turns[n]) - 16, (n, cached, len(prompt))
        else:
            assert cached == 0
    if method == "eagle":  # the drafter's target features are kept beside the entries
        assert all(b.features is not None for b in warm.prefix_cache._blocks.values())


def test_interleaved_sessions_under_evictions_give_the_cold_answers(dirs):
    """Four sessions of three turns, their turns interleaved at random, on a cache far smaller
    than their history (it evicts all along, and never holds more than its budget)."""
    rng = random.Random(7)
    warm, cold = decoder(dirs, "lookup", True), decoder(dirs, "lookup", False)
    cache = warm.target_backend.cache
    one = cache.kv[:, :, :, :1].numel() * cache.kv.element_size()
    warm.prefix_cache = per_token = PrefixCache(100 * one)  # about 100 positions' entries
    sessions = {s: [ids(rng, 40 + 10 * s), ids(rng, 12), ids(rng, 5)] for s in range(4)}
    history = {s: [] for s in sessions}
    order = [s for s in sessions for _ in range(3)]
    rng.shuffle(order)
    reused = 0
    for s in order:
        prompt = history[s] + sessions[s].pop(0)
        res = warm.start(prompt, 16, logprobs=1).result()
        want = cold.start(prompt, 16, logprobs=1).result()
        assert (res.token_ids, res.logprobs) == (want.token_ids, want.logprobs), (s, len(prompt))
        assert per_token.bytes <= per_token.budget_bytes
        reused += res.stats.cached_tokens
        history[s] = prompt + res.token_ids
    assert per_token.evictions > 0 and reused > 0


def test_a_shared_system_prompt_is_held_once(dirs):
    rng = random.Random(3)
    system = ids(rng, 64)
    dec = decoder(dirs, "ar", True)
    a = dec.start(system + ids(rng, 10), 8).result()
    blocks = len(dec.prefix_cache)
    b = dec.start(system + ids(rng, 10), 8).result()
    assert a.stats.cached_tokens == 0 and b.stats.cached_tokens == 64
    # the second session added only its own blocks: the system prompt's four are shared
    assert len(dec.prefix_cache) - blocks < blocks


def test_batch_members_and_n_copies_share_the_cache_and_give_the_cold_answers(dirs):
    rng = random.Random(5)
    system = ids(rng, 48)
    prompts = [system + ids(rng, 6 + i) for i in range(3)]
    warm, cold = decoder(dirs, "lookup", True), decoder(dirs, "lookup", False)
    warm.generate(system + ids(rng, 3), 4)  # the system prompt is cached now
    got = warm.generate_batch(prompts + prompts[:1], 16)
    want = [cold.start(p, 16).result().token_ids for p in prompts + prompts[:1]]
    assert [r.token_ids for r in got] == want
    assert all(r.stats.cached_tokens >= 48 for r in got)


def test_cancelled_generations_leave_the_cache_consistent(dirs):
    rng = random.Random(9)
    prompt = ids(rng, 70)
    warm, cold = decoder(dirs, "ar", True), decoder(dirs, "ar", False)
    with torch.inference_mode():
        batch = Batch(4)
        early = warm.start(prompt, 16)
        warm.join(batch, early)
        warm.leave(batch, early)  # before its prefill: nothing of it is kept
        assert len(warm.prefix_cache) == 0 and early.finish_reason == "cancelled"
        late = warm.start(prompt, 16)
        warm.join(batch, late)
        batch.step()  # its prefill
        batch.step()  # one step
        warm.leave(batch, late)
    assert len(warm.prefix_cache) == len(prompt) // 16
    more = prompt + ids(rng, 5)
    res = warm.start(more, 16).result()
    assert res.stats.cached_tokens == 64
    assert res.token_ids == cold.start(more, 16).result().token_ids


def test_cache_prompt_false_neither_reads_nor_writes(dirs):
    rng = random.Random(11)
    prompt = ids(rng, 50)
    dec = decoder(dirs, "ar", True)
    first = dec.start(prompt, 8, cache_prompt=False).result()
    assert len(dec.prefix_cache) == 0 and first.stats.cached_tokens == 0
    dec.start(prompt, 8).result()
    again = dec.start(prompt, 8, cache_prompt=False).result()
    assert again.stats.cached_tokens == 0 and again.token_ids == first.token_ids


def test_a_bad_cache_ram_is_refused(dirs):
    from speculant.errors import ConfigError

    for bad in (-1, 1.5, "8G"):
        with pytest.raises(ConfigError, match="cache_ram is the prefix cache's memory in MiB"):
            SpeculativeDecoder(dirs["target"], method="ar", backend="native", cache_ram=bad)


def test_a_soak_of_batched_sessions_holds_the_budget_and_gives_the_cold_answers(dirs):
    """Eight sessions of three turns, each round every session's next turn in one batch (members
    insert their blocks while others restore theirs), on a cache of about 160 positions."""
    rng = random.Random(13)
    warm, cold = decoder(dirs, "lookup", True), decoder(dirs, "lookup", False)
    cache = warm.target_backend.cache
    one = cache.kv[:, :, :, :1].numel() * cache.kv.element_size()
    warm.prefix_cache = pc = PrefixCache(160 * one)
    system = ids(rng, 32)
    history = [system + ids(rng, 8 + s) for s in range(8)]
    for _ in range(3):
        got = warm.generate_batch(history, 12, max_batch=4)
        for s, res in enumerate(got):
            assert res.token_ids == cold.start(history[s], 12).result().token_ids, s
            history[s] = history[s] + res.token_ids + ids(rng, 5)
        assert pc.bytes <= pc.budget_bytes
    assert pc.evictions > 0 and pc.tokens_reused > 0


def test_with_the_cache_prompts_run_on_the_decoding_kernels_by_default(dirs, monkeypatch):
    """Without SPECULANT_EXACT_PREFILL: a decoder with a prefix cache prefills prompts on the
    decoding kernels (unless its prefill kernels widen the weights, AMX's), so a later turn from
    the cache is the cold request's answer bit for bit; a decoder without the cache keeps the
    prompt attention's flash kernel, whose bits differ (the negative control)."""
    monkeypatch.delenv("SPECULANT_EXACT_PREFILL")
    rng = random.Random(17)
    warm, flash = decoder(dirs, "ar", True), decoder(dirs, "ar", False)
    if warm.target_backend.widened_prefill:
        pytest.skip("the prefill kernels widen the weights on this CPU (AMX): cached and cold prompts differ anyway")
    assert warm.exact_prompts and not flash.exact_prompts
    turns = [ids(rng, 130), ids(rng, 110)]
    (_, first), (prompt, second) = play(warm, turns)
    assert second.stats.cached_tokens >= 144
    cold = warm.start(prompt, 24, logprobs=2, cache_prompt=False).result()
    assert cold.stats.cached_tokens == 0
    assert (second.token_ids, second.logprobs) == (cold.token_ids, cold.logprobs)
    other = flash.start(prompt, 24, logprobs=2).result()
    assert other.logprobs != cold.logprobs  # flash attention over the 240-token prompt: other bits
