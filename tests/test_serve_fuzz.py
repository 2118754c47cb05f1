"""Hypothesis fuzzes ``speculant serve`` on loopback with generated requests: valid ones and
mutations of them (lone surrogates, NUL, huge and negative numbers, NaN, wrong types, unknown
fields, deep nesting, broken UTF-8, cut-off JSON; penalties, logit bias, min_p and logprobs), a
few at a time, streaming and not, on both worker paths. Every answer must be a 200 (with one
logprobs entry per token, if asked for) or a well-formed 4xx in OpenAI's error shape (never a 5xx,
never a hang), and after every batch a normal request must still get its usual answer.

Bounded: a fixed number of examples, derandomized (the same ones every run), no shrinking, and a
timeout on every request."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import httpx
import pytest
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

from speculant import SpeculativeDecoder
from speculant.serve.schema import ROLES

from serve_helpers import CHAT_TEMPLATE, RunningServer
from tiny import tiny_model_dir

MESSAGES = [{"role": "user", "content": "w1 w2 w3 w4"}]
GOOD = {"model": "default", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
TIMEOUT = 60  # seconds per request: a hang fails the test


@pytest.fixture(scope="module", params=[1, 4], ids=["one-at-a-time", "batched"])
def server(request, tmp_path_factory):
    target = tiny_model_dir(tmp_path_factory.mktemp("models") / "target", seed=0)
    dec = SpeculativeDecoder(str(target), method="lookup", dtype="float32", tree_budget="fixed")
    dec.tokenizer.chat_template = CHAT_TEMPLATE
    s = RunningServer(dec, max_batch=request.param)
    s.expected = dec.generate(MESSAGES, 8).text  # before the server's worker uses the decoder
    yield s
    s.stop()


# ---- strategies ------------------------------------------------------------------------------
PIECES = st.one_of(st.characters(), st.characters(categories=["Cs"]),  # Cs: lone surrogates
                   st.sampled_from(["\x00", " ", "w1 ", "w7 "]))
STRINGS = st.one_of(st.lists(PIECES, max_size=8).map("".join),
                    st.sampled_from(["w1 w2", "", "  ", "default", "user", "text", "\ud800 hi", "\U0001f600"]))
NUMBERS = st.one_of(st.integers(), st.floats(),  # floats: NaN and infinities too
                    st.sampled_from([0, 1, -1, 2, 3, 0.5, 1.0, 2.0, 2.5, -0.0, 5e-324, 1e308, 511, 512, 100000,
                                     2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400]))
JSON = st.recursive(st.none() | st.booleans() | NUMBERS | STRINGS,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(STRINGS, inner, max_size=3),
                    max_leaves=6)
PART = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": STRINGS}), JSON)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(ROLES) | STRINGS, "content": STRINGS | st.lists(PART, max_size=3)},
                          optional={"name": STRINGS | JSON, "tool_calls": JSON}),
    JSON)
SMALL = st.integers(1, 12)  # few tokens: a valid request stays quick
FIELDS = {
    "model": st.sampled_from(["default", "tiny"]) | STRINGS | JSON,
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "prompt": STRINGS | st.lists(STRINGS, max_size=2) | JSON,
    "max_tokens": SMALL | NUMBERS | JSON,
    "max_completion_tokens": SMALL | NUMBERS | JSON,
    "temperature": st.floats(0, 2) | NUMBERS | JSON,
    "top_p": st.floats(0, 1) | NUMBERS | JSON,
    "top_k": st.integers(0, 70) | NUMBERS | JSON,
    "seed": st.integers(-(2**63), 2**63 - 1) | NUMBERS | JSON,
    "stop": STRINGS | st.lists(STRINGS, max_size=6) | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
    "n": st.sampled_from([1, 2, 0, None]) | JSON,
    "user": STRINGS | JSON,
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | JSON,
    "logprobs": st.booleans() | st.integers(0, 21) | JSON,
    "top_logprobs": st.integers(0, 21) | NUMBERS | JSON,
    "presence_penalty": st.floats(-2, 2) | NUMBERS | JSON,
    "frequency_penalty": st.floats(-2, 2) | NUMBERS | JSON,
    "repetition_penalty": st.floats(0, 3) | NUMBERS | JSON,
    "min_p": st.floats(0, 1) | NUMBERS | JSON,
    "logit_bias": st.dictionaries(st.integers(0, 70).map(str) | STRINGS, st.floats(-100, 100) | NUMBERS | JSON,
                                  max_size=4) | JSON,
}
DELETE = object()
CHANGE = st.one_of(*[st.tuples(st.just(name), values) for name, values in FIELDS.items()],
                   st.tuples(STRINGS, JSON),  # an unknown field (or a known one, any value)
                   st.tuples(st.sampled_from(["model", "messages", "prompt", "temperature"]), st.just(DELETE)))
BASES = {CHAT: {"model": "default", "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 4,
                "temperature": 0},
         TEXT: {"model": "default", "prompt": "w5 w6 w7", "max_tokens": 4, "temperature": 0}}


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    """An endpoint and a body: a valid request with a few fields changed, as JSON (ASCII, or UTF-8
    where a lone surrogate becomes bytes no UTF-8 decoder takes), or raw bytes."""
    path = draw(st.sampled_from([CHAT, TEXT]))
    kind = draw(st.sampled_from(["mutated"] * 6 + ["nested", "bytes", "cut"]))
    body = dict(BASES[draw(st.sampled_from([CHAT, TEXT]))] if draw(st.integers(0, 9)) == 0 else BASES[path])
    if draw(st.integers(0, 2)) == 0:
        body["stream"] = True
    for name, value in draw(st.lists(CHANGE, max_size=4)):
        if value is DELETE:
            body.pop(name, None)
        else:
            body[name] = value
    if kind == "bytes":
        return path, draw(st.binary(max_size=64))
    if kind == "nested":  # deep nesting in a field, around the limit and far beyond it
        depth = draw(st.sampled_from([62, 63, 64, 65, 1000, 10000, 100000]))
        field = draw(st.sampled_from(["metadata", "messages", "stop", "prompt", "user"]))
        head = json.dumps({k: v for k, v in BASES[path].items() if k != field})[:-1].encode()
        return path, head + f', "{field}": '.encode() + b"[" * depth + b"]" * depth + b"}"
    text = json.dumps(body, ensure_ascii=draw(st.booleans()))
    raw = text.encode("utf-8", "surrogatepass")
    if kind == "cut":
        raw = raw[: draw(st.integers(0, len(raw)))]
    return path, raw


# ---- checks ----------------------------------------------------------------------------------
def _answer(url: str, path: str, raw: bytes) -> tuple[int, str | None, bytes, list[str]]:
    """(status, content type, body, SSE data lines) of one request."""
    with httpx.stream("POST", url + path, content=raw, headers={"Content-Type": "application/json"},
                      timeout=TIMEOUT) as r:
        ctype = r.headers.get("content-type", "")
        if r.status_code == 200 and ctype.startswith("text/event-stream"):
            return r.status_code, ctype, b"", [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        return r.status_code, ctype, r.read(), []


def _check(path: str, raw: bytes, status: int, ctype: str, content: bytes, events: list[str]) -> None:
    where = f"{path} {raw[:300]!r} -> {status} {content[:300]!r} {events[-3:]}"
    event(f"{status}{' stream' if events else ''}")  # pytest --hypothesis-show-statistics shows the mix
    assert status == 200 or 400 <= status < 500, where
    if events:  # a stream: chunks, at most one error (not the server's fault), then [DONE]
        assert events[-1] == "[DONE]", where
        chunks = [json.loads(e) for e in events[:-1]]
        errors = [c["error"] for c in chunks if "error" in c]
        assert all(e["type"] != "server_error" for e in errors), where
        assert all("choices" in c for c in chunks if "error" not in c), where
        return
    assert ctype.startswith("application/json"), where
    answer = json.loads(content)
    if status == 200:
        assert len(answer["choices"]) == 1 and answer["usage"]["completion_tokens"] >= 0, where
        logprobs = answer["choices"][0]["logprobs"]
        if logprobs is not None:  # one entry per completion token
            entries = logprobs["content"] if "content" in logprobs else logprobs["tokens"]
            assert len(entries) == answer["usage"]["completion_tokens"], where
        return
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}, where
    assert isinstance(error["message"], str) and error["message"] and error["type"] != "server_error", where


ISSUE_51 = rb'{"model":"default","messages":[{"role":"user","content":"\ud800 hi"}],"max_tokens":4}'


@settings(max_examples=100, deadline=timedelta(seconds=4 * TIMEOUT), derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(batch=st.lists(bodies(), min_size=1, max_size=4))
@example(batch=[(CHAT, ISSUE_51), (TEXT, ISSUE_51), (CHAT, ISSUE_51[:-1] + b', "stream": true}')])
@example(batch=[(CHAT, b'{"model": "default", "messages": ' + b"[" * 10000 + b"]" * 10000 + b"}"),
                (CHAT, b'{"model": "default", "prompt": "w1", "max_tokens": 4, "top_k": 1' + b"0" * 5000 + b"}")])
def test_fuzzed_requests_get_a_200_or_a_clear_4xx_and_the_server_keeps_answering(server, batch):
    results: dict[int, tuple] = {}

    def send(i: int, path: str, raw: bytes) -> None:
        try:
            results[i] = _answer(server.url, path, raw)
        except Exception as e:  # noqa: BLE001 -- reported below, with the request
            results[i] = e

    threads = [threading.Thread(target=send, args=(i, path, raw)) for i, (path, raw) in enumerate(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 10)
    for i, (path, raw) in enumerate(batch):
        got = results.get(i)
        assert isinstance(got, tuple), f"{path} {raw[:300]!r}: {got!r}"
        _check(path, raw, *got)
    ok = httpx.post(server.url + CHAT, json=GOOD, timeout=TIMEOUT)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == server.expected
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).json()["status"] == "ok"
