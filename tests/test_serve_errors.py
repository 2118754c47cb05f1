"""``speculant serve`` refuses bad requests with a 4xx in OpenAI's error shape and a message that
names the problem (text that is not Unicode, NUL, deep nesting and numbers out of range too), and
still answers correctly afterwards; every bad penalty, logit bias, min_p and logprobs value is a
400 naming its field, on both endpoints, streaming or not; an API key is enforced; SIGTERM lets a
request in flight finish before the process exits; the default target answers the openai client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from speculant import SpeculativeDecoder

from serve_helpers import CHAT_TEMPLATE, RunningServer, free_port, wait_healthy
from tiny import tiny_model_dir

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "w1 w2 w3 w4"}]
GOOD = {"model": "default", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(tiny_model_dir(tmp_path_factory.mktemp("models") / "target", seed=0))


@pytest.fixture(scope="module")
def server(target):
    dec = SpeculativeDecoder(target, method="lookup", dtype="float32", tree_budget="fixed")
    dec.tokenizer.chat_template = CHAT_TEMPLATE
    s = RunningServer(dec, api_key=KEY, max_body_bytes=64 * 1024)
    s.expected = dec.generate(MESSAGES, 8).text  # before the server's worker uses the decoder
    yield s
    s.stop()


def _with(**fields):
    body = {**GOOD, **fields}
    return {k: v for k, v in body.items() if v is not ...}


LONG = " ".join(f"w{i % 50 + 3}" for i in range(600))  # the tiny models' context is 512 tokens
HEAD = b'{"model": "default", "max_tokens": 8, '
CHAT = HEAD + b'"messages": [{"role": "user", "content": "w1"}], '
BAD = [
    # (name, body or raw bytes, extra headers, status, words the message must contain)
    ("invalid JSON", b'{"model": "default", "messages": [', {}, 400, "not valid JSON"),
    ("invalid UTF-8", b'{"model": "default", "messages": "\xff\xfe"}', {}, 400, "not valid UTF-8"),
    ("not an object", [1, 2], {}, 400, "must be a JSON object"),
    ("wrong type", _with(max_tokens="8"), {}, 400, "'max_tokens' must be an integer"),
    ("unknown model", _with(model="gpt-9"), {}, 404, "'gpt-9' is not served here"),
    ("no model", _with(model=...), {}, 400, "'model' is required"),
    ("empty messages", _with(messages=[]), {}, 400, "'messages' must be a non-empty list"),
    ("unknown role", _with(messages=[{"role": "wizard", "content": "w1"}]), {}, 400, "role is 'wizard'"),
    ("content not text", _with(messages=[{"role": "user", "content": 5}]), {}, 400, "content must be a string"),
    ("max_tokens 0", _with(max_tokens=0), {}, 400, "'max_tokens' must be an integer >= 1"),
    ("max_tokens beyond the context", _with(max_tokens=100000), {}, 400, "context is 512 tokens"),
    ("negative temperature", _with(temperature=-0.5), {}, 400, "'temperature' must be between 0 and 2"),
    ("top_p 0", _with(top_p=0), {}, 400, "'top_p' must be in (0, 1]"),
    ("top_p above 1", _with(top_p=1.5), {}, 400, "'top_p' must be in (0, 1]"),
    ("five stop strings", _with(stop=["a", "b", "c", "d", "e"]), {}, 400, "at most 4"),
    ("an empty stop string", _with(stop=["a", ""]), {}, 400, "'stop' has an empty string"),
    ("n = 17", _with(n=17), {}, 400, "'n' must be an integer from 1 to 16"),
    ("n = 0", _with(n=0), {}, 400, "'n' must be an integer from 1 to 16"),
    ("echo", _with(echo=True), {}, 400, "'echo' is not supported"),
    ("tools", _with(tools=[{"type": "function", "function": {"name": "f"}}]), {}, 400, "no tool support"),
    ("unknown response format", _with(response_format={"type": "yaml"}), {}, 400, "response_format type must be"),
    ("unknown field", _with(temprature=0.5), {}, 400, "unknown field 'temprature'"),
    ("stream_options without stream", _with(stream_options={"include_usage": True}), {}, 400, "only allowed"),
    ("prompt too long", _with(messages=[{"role": "user", "content": LONG}]), {}, 400, "tokens but the model's context is 512"),
    ("prompt and max_tokens beyond the context", _with(messages=[{"role": "user", "content": LONG[:1200]}],
                                                       max_tokens=300), {}, 400, "but the model's context is 512"),
    ("oversized body", b'{"model": "default", "pad": "' + b"x" * (70 * 1024) + b'"}', {}, 413, "limit"),
    ("a lone surrogate", HEAD + rb'"messages": [{"role": "user", "content": "\ud800 hi"}]}', {}, 400,
     "messages[0].content has a lone surrogate U+D800 at character 0"),
    ("a lone surrogate in a text part", HEAD + rb'"messages": [{"role": "user", "content": [{"type": "text", '
                                               rb'"text": "w1 \udc00"}]}]}', {}, 400, "messages[0].content[0].text"),
    ("a lone surrogate in a field name", CHAT + rb'"\ud83d": 1}', {}, 400, "a field name in the request body"),
    ("a lone surrogate in the role", HEAD + rb'"messages": [{"role": "\ud800", "content": "w1"}]}', {}, 400,
     "messages[0].role has a lone surrogate U+D800"),
    ("a lone surrogate in the model", rb'{"model": "\udfff", "messages": []}', {}, 400, "model has a lone surrogate U+DFFF"),
    ("NUL in the content", _with(messages=[{"role": "user", "content": "w1\u0000"}]), {}, 400,
     "messages[0].content has a NUL character"),
    ("NUL in a stop string", _with(stop=["w1", "w\u0000"]), {}, 400, "stop[1] has a NUL character"),
    ("NUL in a name", _with(messages=[{"role": "user", "content": "w1", "name": "\u0000"}]), {}, 400,
     "messages[0].name has a NUL"),
    ("a name that is not a string", _with(messages=[{"role": "user", "content": "w1", "name": 5}]), {}, 400,
     "messages[0].name must be a string"),
    ("nested 10,000 deep", CHAT + b'"metadata": ' + b"[" * 10000 + b"]" * 10000 + b"}", {}, 400, "nested too deeply"),
    ("nested 100 deep", CHAT + b'"metadata": ' + b"[" * 100 + b"]" * 100 + b"}", {}, 400, "nested deeper than 64"),
    ("NaN", CHAT + b'"temperature": NaN}', {}, 400, "NaN is not a JSON number"),
    ("an integer of 5000 digits", CHAT + b'"seed": ' + b"7" * 5000 + b"}", {}, 400, "not valid JSON"),
    ("a huge integer temperature", _with(temperature=10**400), {}, 400, "'temperature' must be between 0 and 2"),
    ("a temperature too small to divide by", _with(temperature=5e-324), {}, 400,
     "'temperature' must be 0 (greedy) or"),
    ("a seed beyond 64 bits", _with(seed=2**64), {}, 400, "'seed' must be an integer from"),
    ("a huge top_k", _with(top_k=2**40), {}, 400, "'top_k' must be an integer from 0"),
    ("max_tokens beyond 32 bits", _with(max_tokens=2**63), {}, 400, "'max_tokens' must be an integer >= 1"),
    ("a user that is not a string", _with(user=["me"]), {}, 400, "'user' must be a string"),
    ("missing API key", GOOD, {"Authorization": ""}, 401, "a valid API key is required"),
    ("wrong API key", GOOD, {"Authorization": "Bearer nope"}, 401, "a valid API key is required"),
]


@pytest.mark.parametrize("name, body, headers, status, words", BAD, ids=[b[0] for b in BAD])
def test_a_bad_request_is_a_clear_4xx_and_the_server_still_answers(server, name, body, headers, status, words):
    headers = {**AUTH, **headers}
    if isinstance(body, bytes):
        r = server.post("/v1/chat/completions", content=body, headers={**headers, "Content-Type": "application/json"})
    else:
        r = server.post("/v1/chat/completions", body, headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and words in error["message"], error
    ok = server.post("/v1/chat/completions", GOOD, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == server.expected


TEXT_GOOD = {"model": "default", "prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0}
# the sampling options honoured since the server took them: (endpoints, fields, param, words)
BOTH = ("chat", "completion")
BAD_OPTIONS = [
    (BOTH, {"presence_penalty": 2.5}, "presence_penalty", "'presence_penalty' must be between -2 and 2"),
    (BOTH, {"presence_penalty": "1"}, "presence_penalty", "'presence_penalty' must be a number"),
    (BOTH, {"frequency_penalty": -3}, "frequency_penalty", "'frequency_penalty' must be between -2 and 2"),
    (BOTH, {"frequency_penalty": True}, "frequency_penalty", "'frequency_penalty' must be a number"),
    (BOTH, {"repetition_penalty": 0}, "repetition_penalty", "'repetition_penalty' must be above 0"),
    (BOTH, {"repetition_penalty": -1.5}, "repetition_penalty", "'repetition_penalty' must be above 0"),
    (BOTH, {"repetition_penalty": 1000}, "repetition_penalty", "at most 100"),
    (BOTH, {"min_p": 1}, "min_p", "'min_p' must be in [0, 1)"),
    (BOTH, {"min_p": -0.1}, "min_p", "'min_p' must be in [0, 1)"),
    (BOTH, {"min_p": [0.1]}, "min_p", "'min_p' must be a number"),
    (BOTH, {"logit_bias": [5, -100]}, "logit_bias", "'logit_bias' must be an object"),
    (BOTH, {"logit_bias": {"w1": -100}}, "logit_bias", "'logit_bias' keys must be token ids"),
    (BOTH, {"logit_bias": {"-5": 1}}, "logit_bias", "'logit_bias' keys must be token ids"),
    (BOTH, {"logit_bias": {"9" * 5000: 1}}, "logit_bias", "'logit_bias' keys must be token ids"),
    (BOTH, {"logit_bias": {"5": 101}}, "logit_bias", "'logit_bias' values must be numbers from -100 to 100"),
    (BOTH, {"logit_bias": {"5": "-100"}}, "logit_bias", "'logit_bias' values must be numbers"),
    (BOTH, {"logit_bias": {"5": None}}, "logit_bias", "'logit_bias' values must be numbers"),
    (BOTH, {"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024"),
    (BOTH, {"logit_bias": {"3": 1, "64": -100}}, "logit_bias",
     "token id 64, outside the model's vocabulary (ids 0 to 63)"),
    (("chat",), {"logprobs": "yes"}, "logprobs", "'logprobs' must be true or false"),
    (("chat",), {"logprobs": 1}, "logprobs", "'logprobs' must be true or false"),
    (("chat",), {"top_logprobs": 2}, "top_logprobs", "'top_logprobs' is only allowed with \"logprobs\": true"),
    (("chat",), {"logprobs": False, "top_logprobs": 0}, "top_logprobs", "only allowed with"),
    (("chat",), {"logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "'top_logprobs' must be an integer from 0 to 20"),
    (("chat",), {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "from 0 to 20"),
    (("chat",), {"logprobs": True, "top_logprobs": 2.0}, "top_logprobs", "from 0 to 20"),
    (("completion",), {"logprobs": True}, "logprobs", "'logprobs' must be an integer from 0 to 20"),
    (("completion",), {"logprobs": 21}, "logprobs", "'logprobs' must be an integer from 0 to 20"),
    (("completion",), {"logprobs": "3"}, "logprobs", "'logprobs' must be an integer"),
    (("completion",), {"top_logprobs": 3}, "top_logprobs", "'top_logprobs' is a chat field"),
]


@pytest.mark.parametrize("endpoints, fields, param, words", BAD_OPTIONS,
                         ids=[f"{'+'.join(b[0])}-{b[2]}-{i}" for i, b in enumerate(BAD_OPTIONS)])
def test_a_bad_sampling_option_is_a_400_naming_it(server, endpoints, fields, param, words):
    for kind in endpoints:
        path, good = ("/v1/chat/completions", GOOD) if kind == "chat" else ("/v1/completions", TEXT_GOOD)
        for stream in (False, True):
            r = server.post(path, {**good, **fields, "stream": stream}, headers=AUTH)
            assert r.status_code == 400, (kind, r.text)
            error = r.json()["error"]
            assert error["param"] == param and words in error["message"], (kind, error)
            assert error["type"] == "invalid_request_error"
    ok = server.post("/v1/chat/completions", GOOD, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == server.expected


def test_good_sampling_options_are_taken(server):
    options = {"presence_penalty": -2, "frequency_penalty": 2.0, "repetition_penalty": 1, "min_p": 0,
               "logit_bias": {"63": -100, "0": 100.0}}
    for path, good, logprobs in (("/v1/chat/completions", GOOD, {"logprobs": True, "top_logprobs": 20}),
                                 ("/v1/completions", TEXT_GOOD, {"logprobs": 20, "top_logprobs": 0})):
        r = server.post(path, {**good, **options, **logprobs}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"] is not None
    for off in ({"logprobs": False}, {"logprobs": None, "top_logprobs": None}):
        r = server.post("/v1/chat/completions", {**GOOD, **off}, headers=AUTH)
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


def test_the_lone_surrogate_of_issue_51_is_a_400_naming_the_field_and_the_server_goes_on(server):
    """The request that once stopped the worker: valid JSON whose content is a lone UTF-16 surrogate."""
    body = rb'{"model":"default","messages":[{"role":"user","content":"\ud800 hi"}],"max_tokens":4}'
    for path in ("/v1/chat/completions", "/v1/completions"):
        raw = body if path.endswith("chat/completions") else rb'{"model":"default","prompt":"\ud800 hi","max_tokens":4}'
        for stream in (b"", b', "stream": true'):
            r = server.post(path, content=raw[:-1] + stream + b"}",
                            headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == ("messages[0].content" if "chat" in path else "prompt"), error
            assert "lone surrogate U+D800" in error["message"] and error["type"] == "invalid_request_error"
    ok = server.post("/v1/chat/completions", GOOD, headers=AUTH, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == server.expected
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_the_api_key_guards_v1_but_not_health(server):
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    assert client.chat.completions.create(**GOOD).choices[0].message.content == server.expected
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert server.post("/v1/nothing", GOOD, headers=AUTH).json()["error"]["code"] == "not_found"


def test_sigterm_lets_the_request_in_flight_finish(target):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "speculant.cli", "serve", "--target", target, "--dtype", "float32",
                             "--method", "ar", "--port", str(port)], stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        body = {"model": "default", "prompt": "w1 w2 w3", "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"  # the stream ran to its end
        # uvicorn re-raises the signal once it has shut down, so the exit status says "terminated"
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.real
@pytest.mark.slow
def test_the_default_target_answers_a_chat_completion():
    from speculant.cli.commands import DEFAULT_TARGET

    dec = SpeculativeDecoder(DEFAULT_TARGET)
    s = RunningServer(dec)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
        got = client.chat.completions.create(model="default", messages=messages, max_tokens=24, temperature=0)
    finally:
        s.stop()
    assert got.choices[0].message.content == dec.generate(messages, 24).text
    assert got.usage.completion_tokens == 24 and got.usage.model_extra["speculative"]["method"] == dec.method
