"""``speculant serve`` on tiny random models, through the real ``openai`` client and raw HTTP:
chat and text completions, streaming and not, stop strings, seeds, usage; greedy output equal to
``SpeculativeDecoder.generate`` for every exact method; 50 concurrent streaming clients; a client
that leaves mid-stream; a full queue; a failing generation; 15+ kinds of bad request; metrics."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from speculant import ConfigError
from speculant.tuning.costmodel import PassCost
from speculant.heads import HeadsConfig, MedusaHeads, save_heads

from serve_helpers import RunningServer, tiny_decoder
from serve_helpers import client, dirs, reference, server  # noqa: F401 (the fixtures)

FLAT = PassCost((1, 64), (100.0, 100.0))
N = 20
MESSAGES = [{"role": "system", "content": "w3"}, {"role": "user", "content": "w1 w2 w3 w4 w1 w2"}]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [server.app.state.model_id]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["method"] == "sd"


def test_chat_completion_equals_generate(client, reference):
    want = reference.generate(MESSAGES, N)
    got = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=N, temperature=0)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert got.usage.prompt_tokens == want.prompt_tokens and got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == want.prompt_tokens + len(want.token_ids)
    spec = got.usage.model_extra["speculative"]
    assert spec["method"] == "sd" and spec["target_calls"] >= 1 and spec["tokens_per_call"] >= 1.0


def test_chat_stream_adds_up_to_the_same_text_and_reports_usage(client, reference):
    want = reference.generate(MESSAGES, N)
    chunks = list(client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=N, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_text_completion_stream_and_not(client, reference):
    prompt = "w5 w6 w7 w5 w6"
    want = reference.generate(prompt, N)
    got = client.completions.create(model="default", prompt=prompt, max_tokens=N, temperature=0)
    assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.token_ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="default", prompt=prompt, max_tokens=N, temperature=0, stream=True) if c.choices)
    assert streamed == want.text


def test_stop_strings_through_the_server(client, reference):
    full = reference.generate(MESSAGES, N).text
    stop = " ".join(full.split(" ")[3:5])
    for stream in (False, True):
        kw = dict(model="default", messages=MESSAGES, max_tokens=N, temperature=0, stop=["never", stop])
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][0]
        else:
            got = client.chat.completions.create(**kw)
            text, reason = got.choices[0].message.content, got.choices[0].finish_reason
        assert text == full[:full.find(stop)] and reason == "stop"


def test_a_seed_reproduces_a_sampled_completion(client):
    def sample(seed):
        return client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=N, temperature=1.0,
                                              seed=seed).choices[0].message.content
    assert sample(3) == sample(3)
    assert len({sample(s) for s in range(6)}) > 1  # the seed matters (negative control)


@pytest.mark.parametrize("method, extra", [("ar", {}), ("mcsd", {"tree": "2x2x1"}),
                                           ("lookup", {"gamma": 5, "tree_budget": "fixed"}), ("medusa", None)])
def test_greedy_through_the_server_equals_generate_for_every_exact_method(dirs, reference, method, extra):
    if extra is None:  # random heads: they propose poorly, the target still decides every token
        lm = reference.target
        heads = dirs["root"] / "heads"
        save_heads(MedusaHeads(HeadsConfig(3, 1, lm.model.config.hidden_size, lm.logits_dim),
                               lm.model.get_output_embeddings()), heads)
        extra = {"heads": str(heads), "tree_budget": FLAT}
    s = RunningServer(tiny_decoder(dirs, method, **extra))
    try:
        for messages in (MESSAGES, [{"role": "user", "content": "w9 w8 w7 w9 w8"}]):
            got = s.post("/v1/chat/completions", {"model": "default", "messages": messages, "max_tokens": N,
                                                  "temperature": 0}).json()
            assert got["choices"][0]["message"]["content"] == reference.generate(messages, N).text, method
            assert got["usage"]["speculative"]["method"] == method
    finally:
        s.stop()


def _stream_text(url: str, body: dict) -> tuple[str, int]:
    text, status = [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        status = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    text.append(chunk["choices"][0]["delta"].get("content") or "")
    return "".join(text), status


def test_fifty_concurrent_streaming_clients_each_get_their_own_full_output(server, reference):
    prompts = [[{"role": "user", "content": f"w{i % 50 + 3} w{(i * 7) % 50 + 3} w{(i * 3) % 50 + 3}"}]
               for i in range(50)]
    want = [reference.generate(p, 12).text for p in prompts]
    got: dict[int, tuple[str, int]] = {}

    def run(i):
        got[i] = _stream_text(server.url, {"model": "default", "messages": prompts[i], "max_tokens": 12,
                                           "temperature": 0})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(got) == list(range(50))
    for i in range(50):
        assert got[i] == (want[i], 200), i


class _Slow:
    """A decoder whose generations yield a token every ``delay`` seconds, and can fail on demand."""

    def __init__(self, decoder, delay: float):
        self._dec, self.delay, self.fail = decoder, delay, None

    def __getattr__(self, name):
        return getattr(self._dec, name)

    def join(self, batch, gen, on_events=None, on_error=None):  # the worker's way in
        outer, count = self, [0]

        def events(g, evs):
            for _ in evs:
                if outer.fail == count[0]:
                    outer.fail = None
                    raise RuntimeError("injected fault")
                count[0] += 1
                time.sleep(outer.delay)
            if on_events is not None:
                on_events(g, evs)
        return self._dec.join(batch, gen, events, on_error)


def _metric(url: str, name: str, **labels) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@pytest.mark.parametrize("max_batch", [1, 3])  # one at a time; continuous batching
def test_a_client_that_leaves_is_cancelled_a_full_queue_is_429_and_a_fault_spares_the_next(dirs, reference, max_batch):
    slow = _Slow(tiny_decoder(dirs, "ar"), delay=0.05)
    s = RunningServer(slow, max_queue=1, max_batch=max_batch)
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 200, "temperature": 0}
    try:
        # a client reads two chunks and leaves: its generation stops long before 200 tokens
        with httpx.stream("POST", s.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            next(lines), next(lines)
        deadline = time.monotonic() + 10
        while _metric(s.url, "speculant_generations_total", finish_reason="cancelled") < 1:
            assert time.monotonic() < deadline, "the generation of a client that left was not cancelled"
            time.sleep(0.05)
        assert _metric(s.url, "speculant_completion_tokens_total") < 50
        # max_batch running, one waiting: the next is refused at once
        results = {}

        def post(i):
            results[i] = s.post("/v1/chat/completions", {**body, "max_tokens": 30})
        busy = [threading.Thread(target=post, args=(i,)) for i in range(max_batch + 1)]
        for t in busy:
            t.start()
            time.sleep(0.3)
        third = s.post("/v1/chat/completions", body, timeout=5)
        assert third.status_code == 429 and third.headers["retry-after"] == "2"
        assert "busy" in third.json()["error"]["message"]
        for t in busy:
            t.join(60)
        assert [results[i].status_code for i in range(max_batch + 1)] == [200] * (max_batch + 1)
        # a generation that fails mid-stream ends that stream with an error; the next is whole
        slow.fail = 3
        text, status = _stream_text(s.url, {**body, "max_tokens": N})
        assert status == 200 and len(text.split()) <= 3
        slow.fail = 0
        failed = s.post("/v1/chat/completions", {**body, "max_tokens": N})
        assert failed.status_code == 500 and "injected fault" in failed.json()["error"]["message"]
        ok = s.post("/v1/chat/completions", {**body, "max_tokens": N}).json()
        assert ok["choices"][0]["message"]["content"] == reference.generate(MESSAGES, N).text
    finally:
        s.stop()


def test_metrics_count_requests_tokens_and_acceptance(server, client):
    client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=8, temperature=0)
    url = server.url
    assert _metric(url, "speculant_requests_total", endpoint="/v1/chat/completions", status="200") >= 1
    assert _metric(url, "speculant_completion_tokens_total", method="sd") >= 8
    assert _metric(url, "speculant_time_to_first_token_seconds_count", method="sd") >= 1
    assert _metric(url, "speculant_tokens_per_target_call_count", method="sd") >= 1
    assert _metric(url, "speculant_drafted_by_depth_total", depth="1") >= 1
    names = {f.name for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    assert {"speculant_queue_length", "speculant_tokens_per_second", "speculant_accepted_by_depth"} <= names


def test_bench_serve_concurrency_sends_every_prompt_at_once_and_reports_throughput(dirs, reference):
    """bench-serve's concurrent clients against a batching server: every answer equals its
    one-at-a-time answer, and the table reports the level."""
    from speculant.bench.serve_bench import ServeBenchConfig, _concurrent, format_table

    with pytest.raises(ConfigError, match="concurrency"):
        ServeBenchConfig(concurrency=(0,))
    s = RunningServer(tiny_decoder(dirs, "sd"), max_batch=3)
    try:
        questions = [{"question_id": i, "turns": [f"w{i} w{i + 1} w{i + 2}"]} for i in range(5)]
        level = _concurrent(s.url, "speculant", questions, 3, N)
    finally:
        s.stop()
    assert level["requests"] == 5 and level["total_tok_s"] > 0 and level["completion_tokens"] == sum(
        r["completion_tokens"] for r in level["runs"])
    for q, r in zip(questions, level["runs"]):
        assert r["text"] == reference.generate([{"role": "user", "content": q["turns"][0]}], N).text
    table = format_table({"rows": {}, "concurrency": {"3": {"speculant": {**level, "same_as_plain": 5}}}})
    assert "| 3 | speculant |" in table and "5/5" in table
