"""Tool calling in ``speculant serve``: the Hermes ``<tool_call>`` parser and its streaming state
machine on hand-written outputs (one call, two, malformed JSON, no closing tag, a tag split at every
point, text that only looks like a tag), the request checks (a 400 naming the field), the tools and
earlier calls rendered by the real Qwen2.5 chat template, and the whole path through the ``openai``
client, streaming and not. Tiny random models do not write tool calls, so the end-to-end tests
serve the real Qwen tokenizer with a scripted scheduler: it sends the given completion token by
token (the Qwen tokenizer's own tokens) and records the prompt it was given."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import openai
import pytest

from speculant.serve.errors import APIError
from speculant.serve.schema import parse_request
from speculant.serve.tools import ToolStream, join, parse, tool_format
from speculant.store.chat import chat_messages_prompt

from serve_helpers import CHAT_TEMPLATE, RunningServer, qwen_preset, scripted_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
PARIS = '{"city": "Paris"}'


def _ids(index: int) -> str:
    return f"call_{index}"


def _stream(text: str, pieces: list[str] | None = None) -> list[dict]:
    s = ToolStream(ids=_ids)
    deltas = []
    for piece in pieces if pieces is not None else [text]:
        deltas += s.feed(piece)
    return deltas + s.finish()


def _splits(text: str, seed: int) -> list[str]:
    r, out, i = random.Random(seed), [], 0
    while i < len(text):
        j = i + r.randint(1, 6)
        out.append(text[i:j])
        i = j
    return out


# --- the parser --------------------------------------------------------------------------------

def test_one_call_with_text_before_it():
    content, calls = parse("Let me look.\n" + CALL, ids=_ids)
    assert content == "Let me look."
    assert calls == [{"id": "call_0", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


def test_two_calls_and_no_other_text():
    content, calls = parse(TWO + "\n", ids=_ids)
    assert content is None
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("call_0", "get_weather", '{"city": "Paris"}'), ("call_1", "get_time", "{}")]


def test_malformed_calls_stay_text():
    for text in ['<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',  # bad JSON
                 '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
                 '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
                 'Calling:\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',  # never closed
                 "a <tool b <tool_ c", "plain text  \n"]:
        assert parse(text) == (text, []), text


def test_a_good_call_beside_a_malformed_one():
    bad = '<tool_call>\n{oops}\n</tool_call>'
    content, calls = parse(bad + "\n" + CALL, ids=_ids)
    assert content == bad and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_arguments_written_as_a_json_string_are_accepted():
    content, calls = parse('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>')
    assert content is None and calls[0]["function"]["arguments"] == '{"x": 1}'


@pytest.mark.parametrize("text", [CALL, TWO, "Sure. " + TWO + "\nDone.", "a <tool b " + CALL,
                                  '<tool_call>\n{oops}\n</tool_call> ' + CALL, "no calls here  \n ",
                                  "x" + CALL[:-3]])
def test_streaming_adds_up_to_the_whole_parse_for_every_split(text):
    whole = parse(text, ids=_ids)
    for cut in range(len(text) + 1):  # a tag split at every point
        assert join(_stream(text, [text[:cut], text[cut:]])) == whole, cut
    for seed in range(30):
        assert join(_stream(text, _splits(text, seed))) == whole, seed
    assert join(_stream(text, list(text))) == whole  # a character at a time


def test_streamed_deltas_are_openai_shaped_and_hold_back_a_partial_tag():
    s = ToolStream(ids=_ids)
    assert s.feed("Checking <tool") == [{"content": "Checking"}]  # " <tool" may begin a tag: held
    assert s.feed("_call>\n{\"name\": \"get_weather\", ") == []
    assert s.feed('"arguments": {"city": "Paris"}}\n</tool_') == []
    assert s.feed("call>\n") == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}]
    assert s.finish() == [] and s.calls == 1
    s = ToolStream(ids=_ids)
    assert s.feed("a <tool") == [{"content": "a"}]
    assert s.feed("box> b") == [{"content": " <toolbox> b"}]  # not a tag after all: sent


NAMES = ("get_weather", "get_time")
BARE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
FENCED = '```json\n' + BARE + '\n{"name": "get_time", "arguments": {}}\n```'


@pytest.mark.parametrize("text, calls", [
    (BARE, [("get_weather", PARIS)]),
    ("\n " + BARE + "\n", [("get_weather", PARIS)]),
    (FENCED, [("get_weather", PARIS), ("get_time", "{}")]),
    ('```\n' + BARE + '\n```', [("get_weather", PARIS)]),
    (BARE + " " + BARE, [("get_weather", PARIS)] * 2),
    (BARE + " Done.", []),  # other text: not calls
    ("Sure: " + BARE, []),
    ('{"name": "get_news", "arguments": {}}', []),  # a tool the request did not declare
    ('{"name": "get_weather", "arguments": {"city": }}', []),  # malformed
    ('{{"name": "get_weather"}}}', []),
    ('{"city": "Paris"}', []),  # JSON, but no call
    ("```json\n" + BARE, []),  # no closing fence
    ("`x` " + BARE, []),
])
def test_calls_written_without_tags_are_read_only_when_that_is_all_there_is(text, calls):
    content, got = parse(text, ids=_ids, names=NAMES)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls
    assert content == (None if calls else text)
    assert parse(text, ids=_ids) == (text, [])  # without names (tool_choice other than auto): text
    whole = parse(text, ids=_ids, names=NAMES)
    for cut in range(len(text) + 1):
        s = ToolStream(ids=_ids, names=NAMES)
        assert join(s.feed(text[:cut]) + s.feed(text[cut:]) + s.finish()) == whole, cut
    s = ToolStream(ids=_ids, names=NAMES)
    assert join([d for ch in text for d in s.feed(ch)] + s.finish()) == whole


def test_text_that_cannot_be_bare_calls_streams_at_once():
    s = ToolStream(ids=_ids, names=NAMES)
    assert s.feed("Paris is") == [{"content": "Paris is"}]
    s = ToolStream(ids=_ids, names=NAMES)
    assert s.feed("  {\"name\": \"get_") == []  # may be a call: held
    assert s.feed('news", "arguments": {}} and') == [{"content": '  {"name": "get_news", "arguments": {}} and'}]
    s = ToolStream(ids=_ids, names=NAMES)
    assert s.feed("`x") == [{"content": "`x"}]


# --- the request -------------------------------------------------------------------------------

def _request(**fields):
    return parse_request({"model": "default", "messages": MESSAGES, **fields}, "chat")


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": {"type": "function"}}, "tools", "must be a list"),
    ({"tools": ["f"]}, "tools[0]", "must be an object"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type", "\"function\""),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "must be an object"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name", "1 to 64"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "a b"}}]}, "tools[1].function.name", "letters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "distinct"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters", "JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
     "tools[0].function.description", "must be a string"),
    ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools[0].function", "'extra'"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "not in 'tools'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": "x"}]}, "messages[0].tool_calls",
     "non-empty list"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].id", "must be a string"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f", "arguments": "[1"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON object"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages[0].tool_call_id", "id of the call"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0]", "does not take"),
])
def test_bad_tool_fields_get_a_400_naming_the_field(fields, param, words):
    with pytest.raises(APIError) as e:
        _request(**fields)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


def test_tool_choice_none_and_auto():
    assert _request(tools=[WEATHER]).tools == (WEATHER,)
    assert _request(tools=[WEATHER], tool_choice="auto").tools == (WEATHER,)
    assert _request(tools=[WEATHER], tool_choice="none").tools is None
    assert _request(tools=[], tool_choice="auto").tools is None


def test_a_conversation_with_calls_and_results():
    req = _request(tools=[WEATHER], messages=[
        *MESSAGES,
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": [{"type": "text", "text": "sunny, 21 C"}]}])
    assert req.prompt[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert req.prompt[2] == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_0"}


# --- the real Qwen2.5 chat template ------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_preset()))


def test_the_qwen_template_renders_the_tools_and_earlier_calls(qwen_tokenizer):
    assert tool_format(qwen_tokenizer) == "hermes"
    assert tool_format(SimpleNamespace(chat_template=CHAT_TEMPLATE)) is None
    req = _request(tools=[WEATHER, TIME], messages=[
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 C"}])
    text = chat_messages_prompt(qwen_tokenizer, req.prompt, req.tools)
    assert "# Tools" in text and '"name": "get_weather"' in text
    assert '"description": "The weather in a city now"' in text
    assert '"name": "get_time"' in text and '"required": ["city"]' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


# --- end to end, through the openai client -----------------------------------------------------

@pytest.fixture(scope="module")
def served(qwen_tokenizer):
    served = scripted_server(qwen_tokenizer)
    yield served
    served.server.stop()


def test_a_call_comes_back_as_tool_calls(served, qwen_tokenizer):
    served.script.update(text="I'll check.\n" + TWO, reason="eos")
    reply = served.client.chat.completions.create(model="default", messages=MESSAGES, tools=[WEATHER, TIME])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I'll check."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    prompt = qwen_tokenizer.decode(served.scheduler.jobs[-1].prompt)  # the tools reached the model
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt and prompt.endswith("assistant\n")


def test_calls_stream_as_openai_deltas(served):
    served.script.update(text="I'll check.\n" + TWO, reason="eos")
    chunks = list(served.client.chat.completions.create(model="default", messages=MESSAGES, tools=[WEATHER, TIME],
                                                        stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == "I'll check." and chunks[-1].choices[0].finish_reason == "tool_calls"
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or ():
            if d.id is not None:
                assert d.index not in calls and d.type == "function" and d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                calls[d.index]["arguments"] += d.function.arguments
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_a_bare_call_comes_back_as_tool_calls_with_tool_choice_auto_only(served):
    served.script.update(text="```json\n" + BARE + "\n```", reason="eos")
    for stream in (False, True):
        reply = served.client.chat.completions.create(model="default", messages=MESSAGES, tools=[WEATHER, TIME],
                                                      stream=stream)
        if stream:
            chunks = list(reply)
            assert not "".join(c.choices[0].delta.content or "" for c in chunks)
            deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
            assert [d.function.name for d in deltas if d.id] == ["get_weather"]
            assert "".join(d.function.arguments for d in deltas) == PARIS
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        else:
            msg = reply.choices[0].message
            assert msg.content is None and [c.function.name for c in msg.tool_calls] == ["get_weather"]
            assert reply.choices[0].finish_reason == "tool_calls"
    served.script.update(text=BARE, reason="eos")
    reply = served.client.chat.completions.create(model="default", messages=MESSAGES, tools=[WEATHER],
                                                  tool_choice="none")
    assert reply.choices[0].message.content == BARE and not reply.choices[0].message.tool_calls


def test_a_malformed_call_and_tool_choice_none_stay_text(served):
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    served.script.update(text=bad, reason="eos")
    for stream in (False, True):
        reply = served.client.chat.completions.create(model="default", messages=MESSAGES, tools=[WEATHER],
                                                      stream=stream)
        if stream:
            chunks = list(reply)
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == bad
            assert not any(c.choices[0].delta.tool_calls for c in chunks)
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            assert reply.choices[0].message.content == bad and not reply.choices[0].message.tool_calls
            assert reply.choices[0].finish_reason == "stop"
    served.script.update(text=CALL)
    reply = served.client.chat.completions.create(model="default", messages=MESSAGES, tools=[WEATHER],
                                                  tool_choice="none")
    assert reply.choices[0].message.content == CALL and reply.choices[0].finish_reason == "stop"
    assert '"get_weather"' not in served.server.app.state.scheduler.jobs[-1].prompt.__repr__()


def test_a_call_cut_short_keeps_finish_reason_length(served):
    served.script.update(text=CALL + "\n<tool_call>\n{\"name\": \"get_", reason="length")
    reply = served.client.chat.completions.create(model="default", messages=MESSAGES, tools=[WEATHER])
    assert reply.choices[0].finish_reason == "length"
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_weather"]
    assert reply.choices[0].message.content == "<tool_call>\n{\"name\": \"get_"


def test_tools_on_a_template_without_tool_support_get_a_400(tmp_path):
    from speculant import SpeculativeDecoder
    from tiny import tiny_model_dir

    dec = SpeculativeDecoder(str(tiny_model_dir(tmp_path / "t", seed=0)), method="ar", dtype="float32")
    dec.tokenizer.chat_template = CHAT_TEMPLATE
    server = RunningServer(dec)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="default", messages=[{"role": "user", "content": "w1"}],
                                           tools=[WEATHER], max_tokens=4)
        assert "chat template has no tool support" in e.value.message and e.value.body["param"] == "tools"
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="default", messages=[{"role": "tool", "tool_call_id": "c",
                                                                       "content": "w1"}], max_tokens=4)
        assert e.value.body["param"] == "messages[0]"
        reply = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "w1"}],
                                               tools=[WEATHER], tool_choice="none", max_tokens=4)
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        server.stop()
