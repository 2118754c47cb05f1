"""``speculant serve``'s logprobs, penalties, logit bias and min_p through the real ``openai``
client, on tiny random models with speculation on (a draft model, continuous batching): chat and
completions, streaming and not, the logprobs have OpenAI's shapes and equal (to 1e-4) what
``SpeculativeDecoder.generate(..., logprobs=k)`` of plain decoding gives; streamed chunks carry
the entries of the tokens whose text they carry (a stop string holding text back too); greedy text
with each penalty (and all of them) equals the library's with the same penalties, and differs
from the text without them; a seeded min_p sample equals the library's."""

from __future__ import annotations

import pytest

from serve_helpers import tiny_decoder
from serve_helpers import client, dirs, reference, server  # noqa: F401 (the fixtures)

N = 16
K = 3  # top tokens asked for
TOL = 1e-4
MESSAGES = [{"role": "system", "content": "w3"}, {"role": "user", "content": "w1 w2 w3 w4 w1 w2"}]
PROMPT = "w5 w6 w7 w5 w6"


def _string(dec, token_id: int) -> str:
    return dec.tokenizer.decode([token_id])


def _check_chat_entries(entries, want, dec, k: int = K) -> None:
    """``entries`` (the chat logprobs' content) against ``want`` (a GenerationResult with logprobs)."""
    assert len(entries) == len(want.token_ids) == len(want.logprobs)
    for entry, token_id, lp in zip(entries, want.token_ids, want.logprobs):
        assert entry.token == _string(dec, token_id) and entry.bytes == list(entry.token.encode("utf-8"))
        assert abs(entry.logprob - lp.logprob) < TOL
        assert len(entry.top_logprobs) == len(lp.top) == k
        for top, (i, v) in zip(entry.top_logprobs, lp.top):
            assert top.token == _string(dec, i) and top.bytes == list(top.token.encode("utf-8"))
            assert abs(top.logprob - v) < TOL


def test_chat_logprobs_equal_the_librarys_streaming_and_not(client, reference):
    want = reference.generate(MESSAGES, N, logprobs=K)
    kw = dict(model="default", messages=MESSAGES, max_tokens=N, temperature=0, logprobs=True, top_logprobs=K)
    got = client.chat.completions.create(**kw)
    assert got.choices[0].message.content == want.text and got.usage.completion_tokens == len(want.token_ids)
    _check_chat_entries(got.choices[0].logprobs.content, want, reference)

    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert chunks[0].choices[0].logprobs is None  # the role chunk
    entries, texts = [], []
    for c in chunks:
        texts.append(c.choices[0].delta.content or "")
        if c.choices[0].logprobs is not None:
            assert len(c.choices[0].logprobs.content) == 1  # one chunk per token
            entries += c.choices[0].logprobs.content
    assert "".join(texts) == want.text
    _check_chat_entries(entries, want, reference)
    # each token's chunk carries the text that token brought (nothing is held back here)
    for c, token_id in zip([c for c in chunks if c.choices[0].logprobs is not None], want.token_ids):
        assert c.choices[0].delta.content.strip() == reference.tokenizer.decode([token_id], skip_special_tokens=True)


def test_chat_logprobs_without_top_and_none_unasked(client, reference):
    want = reference.generate(MESSAGES, N, logprobs=0)
    got = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=N, temperature=0,
                                         logprobs=True)
    _check_chat_entries(got.choices[0].logprobs.content, want, reference, k=0)
    plain = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=N, temperature=0)
    assert plain.choices[0].logprobs is None
    chunks = list(client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=N, temperature=0,
                                                 stream=True))
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
    text = client.completions.create(model="default", prompt=PROMPT, max_tokens=N, temperature=0)
    assert text.choices[0].logprobs is None


def test_a_stream_holding_text_back_for_a_stop_string_keeps_tokens_and_text_together(client, reference):
    full = reference.generate(MESSAGES, N).text
    stop = " ".join(full.split(" ")[3:5])
    want = reference.generate(MESSAGES, N, stop=[stop], logprobs=K)
    assert want.finish_reason == "stop" and want.text == full[:full.find(stop)]
    chunks = list(client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=N, temperature=0,
                                                 stop=[stop], logprobs=True, top_logprobs=K, stream=True,
                                                 stream_options={"include_usage": True}))
    with_entries = [c for c in chunks if c.choices and c.choices[0].logprobs is not None]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(with_entries) == len(want.token_ids)
    assert any(c.choices[0].delta.content == "" for c in with_entries)  # a token whose text was held back
    _check_chat_entries([e for c in with_entries for e in c.choices[0].logprobs.content], want, reference)


def _check_completion(lp, text: str, want, dec, k: int = K) -> None:
    """``lp`` (a completions logprobs object) against ``want``; ``text`` the completion's text."""
    assert lp.tokens == [_string(dec, i) for i in want.token_ids]
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(want.token_ids)
    for got, lpw in zip(lp.token_logprobs, want.logprobs):
        assert abs(got - lpw.logprob) < TOL
    for top, lpw in zip(lp.top_logprobs, want.logprobs):
        assert list(top) == [_string(dec, i) for i, _ in lpw.top] and len(top) == k
        assert all(abs(top[_string(dec, i)] - v) < TOL for i, v in lpw.top)
    offsets = lp.text_offset + [len(text)]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for j, token_id in enumerate(want.token_ids):  # the text each token brought (none is held back here)
        assert text[offsets[j]:offsets[j + 1]].strip() == dec.tokenizer.decode([token_id], skip_special_tokens=True)


def test_completion_logprobs_equal_the_librarys_streaming_and_not(client, reference):
    want = reference.generate(PROMPT, N, logprobs=K)
    kw = dict(model="default", prompt=PROMPT, max_tokens=N, temperature=0, logprobs=K)
    got = client.completions.create(**kw)
    assert got.choices[0].text == want.text
    _check_completion(got.choices[0].logprobs, want.text, want, reference)

    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    texts = []
    for c in client.completions.create(stream=True, **kw):
        if not c.choices:
            continue
        texts.append(c.choices[0].text)
        if c.choices[0].logprobs is not None:
            assert len(c.choices[0].logprobs.tokens) == 1
            for key in merged:
                merged[key] += getattr(c.choices[0].logprobs, key)
    assert "".join(texts) == want.text
    assert merged == {key: getattr(got.choices[0].logprobs, key) for key in merged}

    zero = client.completions.create(model="default", prompt=PROMPT, max_tokens=N, temperature=0, logprobs=0)
    _check_completion(zero.choices[0].logprobs, want.text, reference.generate(PROMPT, N, logprobs=0), reference, k=0)


# one option at a time, then all of them: the server's greedy text is the library's with them
PENALTIES = [{"presence_penalty": 1.5}, {"frequency_penalty": 1.2}, {"repetition_penalty": 1.8},
             {"logit_bias": {"28": -100, "40": 6.5}},
             {"presence_penalty": 0.5, "frequency_penalty": -0.3, "repetition_penalty": 1.3,
              "logit_bias": {"13": 2.5}, "min_p": 0.05}]


@pytest.mark.parametrize("options", PENALTIES, ids=lambda o: "+".join(o))
def test_greedy_text_with_penalties_equals_the_librarys(client, reference, options):
    library = {**options, "logit_bias": {int(k): v for k, v in options.get("logit_bias", {}).items()}}
    fields = {k: v for k, v in options.items() if k in ("presence_penalty", "frequency_penalty", "logit_bias")}
    extra = {k: v for k, v in options.items() if k not in fields}  # the extensions
    for prompt in (MESSAGES, PROMPT):
        want = reference.generate(prompt, N, **library)
        assert want.text != reference.generate(prompt, N).text  # the options matter here
        if isinstance(prompt, str):
            kw = dict(model="default", prompt=prompt, max_tokens=N, temperature=0, extra_body=extra, **fields)
            got = client.completions.create(**kw).choices[0].text
            streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
        else:
            kw = dict(model="default", messages=prompt, max_tokens=N, temperature=0, extra_body=extra, **fields)
            got = client.chat.completions.create(**kw).choices[0].message.content
            streamed = "".join(c.choices[0].delta.content or "" for c in
                               client.chat.completions.create(stream=True, **kw) if c.choices)
        assert got == streamed == want.text, (options, prompt)


def test_a_seeded_min_p_sample_equals_the_librarys(dirs, client):
    same = tiny_decoder(dirs, "sd", gamma=3)  # the server's decoder's configuration
    kw = dict(temperature=1.0, seed=7)
    want = same.generate(MESSAGES, N, min_p=0.5, **kw).text
    assert want != same.generate(MESSAGES, N, **kw).text  # min_p matters here
    got = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=N, extra_body={"min_p": 0.5},
                                         **kw)
    assert got.choices[0].message.content == want


def test_the_raw_shapes_are_openais(server):
    chat = server.post("/v1/chat/completions", {"model": "default", "messages": MESSAGES, "max_tokens": 4,
                                                "temperature": 0, "logprobs": True, "top_logprobs": 2}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert list(chat["choices"][0]["logprobs"]) == ["content"] and len(content) == 4
    assert all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 2 and
               all(set(t) == {"token", "logprob", "bytes"} for t in e["top_logprobs"]) for e in content)
    text = server.post("/v1/completions", {"model": "default", "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                           "logprobs": 2}).json()
    lp = text["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert all(len(v) == 4 for v in lp.values()) and all(len(d) == 2 for d in lp["top_logprobs"])


def test_echo_returns_the_prompt_and_scores_its_tokens_with_the_target(client, server, reference):
    """echo (completions): the prompt comes back before the completion, streamed in a chunk of its
    own; with logprobs its tokens come first, the first one's null and each other's the target's
    log-softmax at the position before it (a plain forward of the model, independently), top k
    included; max_tokens 0 scores the prompt and generates nothing, as lm-eval's loglikelihood asks."""
    import torch

    ids = reference.encode(PROMPT)
    with torch.no_grad():
        logp = reference.target.model(ids[None]).logits[0].float().log_softmax(-1)  # (T, V)
    want = reference.generate(PROMPT, N, logprobs=K)
    got = client.completions.create(model="default", prompt=PROMPT, max_tokens=N, temperature=0, logprobs=K,
                                    echo=True)
    lp = got.choices[0].logprobs
    assert got.choices[0].text == PROMPT + want.text
    T = ids.shape[0]
    assert lp.tokens[:T] == [_string(reference, i) for i in ids.tolist()] and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    for j in range(1, T):
        assert abs(lp.token_logprobs[j] - logp[j - 1, ids[j]].item()) < TOL
        top = logp[j - 1].topk(K)
        assert list(lp.top_logprobs[j]) == [_string(reference, i) for i in top.indices.tolist()]
    assert len(lp.tokens) == T + len(want.token_ids)
    assert [abs(a - b.logprob) < TOL for a, b in zip(lp.token_logprobs[T:], want.logprobs)] == [True] * N
    assert lp.text_offset[T] == len(PROMPT)  # the completion's tokens count from the end of the prompt
    assert got.usage.prompt_tokens == T and got.usage.completion_tokens == N

    chunks = [c for c in client.completions.create(model="default", prompt=PROMPT, max_tokens=N, temperature=0,
                                                   echo=True, stream=True) if c.choices]
    assert chunks[0].choices[0].text == PROMPT and "".join(c.choices[0].text for c in chunks) == PROMPT + want.text

    scored = client.completions.create(model="default", prompt=PROMPT, max_tokens=0, logprobs=1, echo=True)
    assert scored.choices[0].text == PROMPT and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[:T]
    plain = client.completions.create(model="default", prompt=PROMPT, max_tokens=3, temperature=0, echo=False)
    assert plain.choices[0].text == want.text[:len(plain.choices[0].text)] and not plain.choices[0].text.startswith(PROMPT)

    for body, field in [({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
                        ({"prompt": PROMPT, "echo": "yes"}, "echo"),
                        ({"messages": MESSAGES, "echo": True}, "echo")]:
        endpoint = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = server.post(endpoint, {"model": "default", **body})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (body, r.json())
