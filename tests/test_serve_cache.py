"""The prefix cache through ``speculant serve`` (tiny models, the real ``openai`` client): a second
chat turn that sends the history again reports ``usage.prompt_tokens_details.cached_tokens`` and
gives the answer a server without a cache gives (bf16 on speculant's kernels with
``SPECULANT_EXACT_PREFILL=1``: a cached continuation and a cold prefill compute their rows
alike); ``cache_prompt: false`` neither reads nor fills the cache; the streamed usage chunk has
the field; ``/metrics`` has the cache's and the KV memory's figures; a ``cache_prompt`` that is
not a boolean is a 400 and the server goes on."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from speculant import SpeculativeDecoder
from speculant.tuning.costmodel import PassCost

from serve_helpers import CHAT_TEMPLATE, RunningServer
from tiny import tiny_llama, tiny_model_dir

FLAT = PassCost((1, 64), (100.0, 100.0))
SYSTEM = " ".join(f"w{(7 * i) % 50 + 3}" for i in range(60))  # a long shared start: several 16-token blocks
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "w1 w2 w3 w4 w1 w2"}]
NEW = 12


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two servers of one tiny bf16 model on the native runtime: ``warm`` with a prefix cache,
    ``cold`` without (both prefilling on the decoding kernels)."""
    from speculant.kernels import x86_kernels

    if x86_kernels() is None:
        pytest.skip("speculant's x86 kernels are not built on this machine: no row-invariant bf16 path to compare on")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECULANT_EXACT_PREFILL", "1")  # read at every forward: the servers run in this process
    target = tiny_model_dir(tmp_path_factory.mktemp("cache") / "target", base=tiny_llama(0, hidden=64, scale=4.0))
    running = {}
    for name, mib in (("warm", 64), ("cold", 0)):
        dec = SpeculativeDecoder(target, method="lookup", backend="native", dtype="bfloat16", tree_budget=FLAT,
                                 pacing=False, cache_ram=mib)
        dec.tokenizer.chat_template = CHAT_TEMPLATE
        running[name] = RunningServer(dec, max_queue=16)
    assert running["warm"].app.state.scheduler.decoder.prefix_cache is not None
    assert running["cold"].app.state.scheduler.decoder.prefix_cache is None
    yield running
    for s in running.values():
        s.stop()
    mp.undo()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(server, messages, **extra):
    return client(server).chat.completions.create(model="default", messages=messages, max_tokens=NEW,
                                                  temperature=0, **extra)


def metrics(server) -> dict[str, float]:
    """/metrics' samples by name (their one label set: the method)."""
    text = httpx.get(server.url + "/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_second_turn_comes_from_the_cache_and_is_the_cold_answer(servers):
    warm, cold = servers["warm"], servers["cold"]
    before = metrics(warm)
    first = chat(warm, FIRST)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # nothing cached yet
    assert first.choices[0].message.content == chat(cold, FIRST).choices[0].message.content
    second = FIRST + [{"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "w5 w6 w7"}]
    got, want = chat(warm, second), chat(cold, second)
    cached = got.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < got.usage.prompt_tokens == want.usage.prompt_tokens and cached % 16 == 0
    assert want.usage.prompt_tokens_details.cached_tokens == 0
    assert got.choices[0].message.content == want.choices[0].message.content  # bit for bit: same tokens
    assert got.usage.completion_tokens == want.usage.completion_tokens
    after = metrics(warm)
    assert after["speculant_prefix_tokens_reused_total"] - before["speculant_prefix_tokens_reused_total"] == cached
    assert after["speculant_prefix_cache_hits_total"] > before["speculant_prefix_cache_hits_total"]
    assert after["speculant_prompt_tokens_cached_total"] - before["speculant_prompt_tokens_cached_total"] == cached


def test_cache_prompt_false_neither_reads_nor_fills_the_cache(servers):
    warm = servers["warm"]
    cache = warm.app.state.scheduler.decoder.prefix_cache
    fresh = [{"role": "system", "content": SYSTEM.replace("w3", "w40")}, {"role": "user", "content": "w9 w8 w7"}]
    blocks = len(cache)
    for _ in range(2):
        off = chat(warm, fresh, extra_body={"cache_prompt": False})
        assert off.usage.prompt_tokens_details.cached_tokens == 0
    assert len(cache) == blocks  # nothing of it was kept
    assert chat(warm, fresh).usage.prompt_tokens_details.cached_tokens == 0  # still cold: it was not filled
    assert chat(warm, fresh, extra_body={"cache_prompt": None}).usage.prompt_tokens_details.cached_tokens > 0
    # the text completions endpoint takes it too
    prompt = "w2 " * 40
    c = client(warm).completions
    assert c.create(model="default", prompt=prompt, max_tokens=4, temperature=0,
                    extra_body={"cache_prompt": False}).usage.prompt_tokens_details.cached_tokens == 0
    c.create(model="default", prompt=prompt, max_tokens=4, temperature=0)
    again = c.create(model="default", prompt=prompt, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_streamed_usage_and_n_choices_report_cached_tokens(servers):
    warm = servers["warm"]
    chat(warm, FIRST)  # cached now, whatever ran before
    chunks = list(chat(warm, FIRST, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    both = chat(warm, FIRST, n=2)  # the prompt counted once, as its tokens are
    assert 0 < both.usage.prompt_tokens_details.cached_tokens < both.usage.prompt_tokens
    assert both.choices[0].message.content == both.choices[1].message.content  # greedy


def test_metrics_expose_the_cache_and_the_kv_memory(servers):
    chat(servers["warm"], FIRST)
    for name, server in servers.items():
        m = metrics(server)
        for key in ("speculant_prefix_cache_bytes", "speculant_prefix_cache_budget_bytes",
                    "speculant_prefix_cache_blocks", "speculant_kv_memory_bytes",
                    "speculant_prefix_tokens_reused_total", "speculant_prefix_cache_hits_total",
                    "speculant_prefix_cache_misses_total", "speculant_prefix_cache_evictions_total",
                    "speculant_prompt_tokens_total", "speculant_prompt_tokens_cached_total"):
            assert key in m and m[key] >= 0, (name, key)
        assert m["speculant_prefix_cache_bytes"] <= m["speculant_prefix_cache_budget_bytes"]
        assert m["speculant_prompt_tokens_cached_total"] <= m["speculant_prompt_tokens_total"]
        assert m["speculant_kv_memory_bytes"] > m["speculant_prefix_cache_bytes"]  # the backends' slabs too
    warm, cold = metrics(servers["warm"]), metrics(servers["cold"])
    assert warm["speculant_prefix_cache_budget_bytes"] == 64 * 2**20 and warm["speculant_prefix_cache_blocks"] > 0
    assert 0 < warm["speculant_prefix_cache_bytes"] and warm["speculant_prefix_cache_misses_total"] >= 1
    assert cold["speculant_prefix_cache_budget_bytes"] == 0 and cold["speculant_prompt_tokens_cached_total"] == 0
    decoder = servers["warm"].app.state.scheduler.decoder
    assert warm["speculant_kv_memory_bytes"] == decoder.kv_memory_bytes()  # nothing runs between the two reads


@pytest.mark.parametrize("path,value", [("/v1/chat/completions", "yes"), ("/v1/completions", 1),
                                        ("/infill", "false")])
def test_a_cache_prompt_that_is_not_a_boolean_is_a_400(servers, path, value):
    warm = servers["warm"]
    body = {"chat": {"model": "default", "messages": FIRST, "max_tokens": 2},
            "/v1/completions": {"model": "default", "prompt": "w1 w2", "max_tokens": 2},
            "/infill": {"input_prefix": "w1 w2", "input_suffix": "w3", "n_predict": 2}}
    r = warm.post(path, {**body["chat" if "chat" in path else path], "cache_prompt": value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith("'cache_prompt' must be true or false, got") and error["param"] == "cache_prompt"
    assert chat(warm, FIRST).choices[0].message.content  # the server goes on
