"""OpenAI's deprecated function calling through ``speculant serve``: ``functions`` as tools,
``function_call`` as tool_choice, ``function`` messages and an assistant's ``function_call`` in
the history as tool results and calls, and the call coming back as ``message.function_call``
(streamed as ``delta.function_call``) with ``finish_reason`` "function_call". Through the real
``openai`` client: a scripted scheduler behind the real Qwen2.5 tokenizer and chat template for
the response's shape and the prompt the model is given, a tiny random Qwen2 for a named
``function_call`` kept to its function's schema by the grammar (a random model writes no call by
itself: the negative control), and every bad value a 400 naming its field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from speculant.serve.schema import parse_request

from serve_helpers import scripted_server, tiny_qwen_server
from serve_helpers import qwen_dir, tokenizer  # noqa: F401 (the fixtures)

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The weather in a city now", "parameters": CITY}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = '{"city": "Paris"}'
HISTORY = [*MESSAGES, {"role": "assistant", "content": None,
                       "function_call": {"name": "get_weather", "arguments": PARIS}},
           {"role": "function", "name": "get_weather", "content": "sunny, 21 C"}]


@pytest.fixture(scope="module")
def scripted(tokenizer):
    served = scripted_server(tokenizer)
    yield served
    served.server.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory, qwen_dir, tokenizer):
    server = tiny_qwen_server(tmp_path_factory.mktemp("functions-serve") / "target", qwen_dir, tokenizer,
                              tmp_path_factory.mktemp("cache"))
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    server.stop()


def _streamed(chunks) -> tuple[str, list[tuple[str | None, str | None]], str]:
    """(content, the function_call deltas as (name, arguments), the last finish reason) of a stream."""
    content, calls = "", []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        assert not delta.tool_calls  # the deprecated form only
        content += delta.content or ""
        if delta.function_call is not None:
            calls.append((delta.function_call.name, delta.function_call.arguments))
    return content, calls, chunks[-1].choices[0].finish_reason


# --- the mapping onto tools --------------------------------------------------------------------

def test_functions_and_function_call_map_onto_tools_and_tool_choice():
    base = {"model": "default", "messages": MESSAGES, "functions": [WEATHER, TIME]}
    req = parse_request(base, "chat")
    assert req.tools == ({"type": "function", "function": WEATHER}, {"type": "function", "function": TIME})
    assert (req.tool_choice, req.tool_name, req.functions) == ("auto", None, True)
    req = parse_request({**base, "function_call": {"name": "get_time"}}, "chat")
    assert (req.tool_choice, req.tool_name) == ("function", "get_time")
    req = parse_request({**base, "function_call": "none"}, "chat")
    assert (req.tool_choice, req.tools) == ("none", None)
    req = parse_request({"model": "default", "messages": MESSAGES, "functions": [], "function_call": "auto"}, "chat")
    assert (req.tool_choice, req.tools, req.functions) == ("none", None, False)
    req = parse_request({"model": "default", "messages": MESSAGES, "tools": [{"type": "function", "function": TIME}]},
                        "chat")
    assert req.functions is False


def test_a_history_in_the_deprecated_form_becomes_tool_calls_and_results():
    req = parse_request({"model": "default", "messages": HISTORY + [
        {"role": "assistant", "function_call": {"name": "get_time"}},
        {"role": "function", "name": "get_time", "content": None}]}, "chat")
    assert req.prompt[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert req.prompt[2] == {"role": "tool", "name": "get_weather", "tool_call_id": "call_1", "content": "sunny, 21 C"}
    assert req.prompt[3]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": {}}
    assert req.prompt[4] == {"role": "tool", "name": "get_time", "tool_call_id": "call_3", "content": ""}


# --- end to end: the response's shape, a scripted completion -----------------------------------

def test_a_call_comes_back_as_function_call(scripted, tokenizer):
    scripted.script.update(text="I'll check.\n" + CALL, reason="eos")
    reply = scripted.client.chat.completions.create(model="default", messages=MESSAGES, functions=[WEATHER, TIME])
    choice = reply.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.content == "I'll check."
    assert choice.message.tool_calls is None and "tool_calls" not in reply.model_dump(exclude_unset=True)[
        "choices"][0]["message"]
    assert (choice.message.function_call.name, choice.message.function_call.arguments) == ("get_weather", PARIS)
    prompt = tokenizer.decode(scripted.scheduler.jobs[-1].prompt)  # the functions reached the model as tools
    assert "# Tools" in prompt and '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt
    chunks = list(scripted.client.chat.completions.create(model="default", messages=MESSAGES,
                                                          functions=[WEATHER, TIME], stream=True))
    content, calls, finish = _streamed(chunks)
    assert content == "I'll check." and finish == "function_call"
    assert calls[0] == ("get_weather", "") and all(name is None for name, _ in calls[1:])
    assert "".join(args for _, args in calls) == PARIS


def test_several_calls_give_the_first(scripted):
    scripted.script.update(text=TWO, reason="eos")
    reply = scripted.client.chat.completions.create(model="default", messages=MESSAGES, functions=[WEATHER, TIME])
    message = reply.choices[0].message
    assert message.content is None and message.function_call.name == "get_weather"
    assert message.function_call.arguments == PARIS and reply.choices[0].finish_reason == "function_call"
    chunks = list(scripted.client.chat.completions.create(model="default", messages=MESSAGES,
                                                          functions=[WEATHER, TIME], stream=True))
    content, calls, finish = _streamed(chunks)
    assert content == "" and [name for name, _ in calls if name] == ["get_weather"]
    assert "".join(args for _, args in calls) == PARIS and finish == "function_call"


def test_function_call_none_and_text_stay_text(scripted):
    scripted.script.update(text=CALL, reason="eos")
    for stream in (False, True):
        reply = scripted.client.chat.completions.create(model="default", messages=MESSAGES, functions=[WEATHER],
                                                        function_call="none", stream=stream)
        if stream:
            assert _streamed(list(reply)) == (CALL, [], "stop")
        else:
            message = reply.choices[0].message
            assert message.content == CALL and message.function_call is None and not message.tool_calls
            assert reply.choices[0].finish_reason == "stop"
    assert "get_weather" not in repr(scripted.scheduler.jobs[-1].prompt)  # the functions were not shown
    scripted.script.update(text="It is sunny.", reason="eos")
    reply = scripted.client.chat.completions.create(model="default", messages=MESSAGES, functions=[WEATHER])
    assert reply.choices[0].message.content == "It is sunny." and reply.choices[0].message.function_call is None
    assert reply.choices[0].finish_reason == "stop"


def test_a_history_with_function_messages_reaches_the_prompt(scripted, tokenizer):
    scripted.script.update(text=CALL, reason="eos")
    first = scripted.client.chat.completions.create(model="default", messages=MESSAGES, functions=[WEATHER])
    scripted.script.update(text="It is sunny in Paris.", reason="eos")
    messages = [*MESSAGES, first.choices[0].message,  # the client's own message object, given back
                {"role": "function", "name": "get_weather", "content": "sunny, 21 C"}]
    for history in (messages, HISTORY):
        reply = scripted.client.chat.completions.create(model="default", messages=history, functions=[WEATHER])
        assert reply.choices[0].message.content == "It is sunny in Paris."
        prompt = tokenizer.decode(scripted.scheduler.jobs[-1].prompt)
        assert CALL in prompt and "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
        assert prompt.endswith("<|im_start|>assistant\n")


# --- end to end: a tiny random model under the grammar -----------------------------------------

def test_a_named_function_call_is_kept_to_its_schema(model):
    kwargs = dict(model="default", messages=MESSAGES, functions=[WEATHER, TIME], max_tokens=64, temperature=0)
    free = model.chat.completions.create(**kwargs)  # the negative control: "auto" leaves the model writing text
    assert free.choices[0].message.function_call is None and free.choices[0].message.content
    reply = model.chat.completions.create(**kwargs, function_call={"name": "get_weather"})
    choice = reply.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.content is None
    assert choice.message.function_call.name == "get_weather" and not choice.message.tool_calls
    arguments = json.loads(choice.message.function_call.arguments)
    jsonschema.validate(arguments, CITY)
    chunks = list(model.chat.completions.create(**kwargs, function_call={"name": "get_weather"}, stream=True))
    content, calls, finish = _streamed(chunks)
    assert content == "" and finish == "function_call"
    assert calls[0][0] == "get_weather" and json.loads("".join(a for _, a in calls)) == arguments
    none = model.chat.completions.create(**kwargs, function_call="none")
    assert none.choices[0].message.function_call is None and none.choices[0].message.content
    assert none.choices[0].finish_reason == "length"


# --- bad values --------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, param, words", [
    ({"functions": {"name": "f"}}, "functions", "must be a list"),
    ({"functions": [3]}, "functions[0]", "must be an object"),
    ({"functions": [{"description": "x"}]}, "functions[0].name", "1 to 64"),
    ({"functions": [WEATHER, {"name": "a b"}]}, "functions[1].name", "letters"),
    ({"functions": [WEATHER, WEATHER]}, "functions[1].name", "distinct"),
    ({"functions": [{"name": "f", "parameters": "x"}]}, "functions[0].parameters", "JSON schema object"),
    ({"functions": [{"name": "f", "description": 3}]}, "functions[0].description", "must be a string"),
    ({"functions": [{"name": "f", "extra": 1}]}, "functions[0]", "'extra'"),
    ({"functions": [WEATHER], "tools": [{"type": "function", "function": TIME}]}, "functions", "'tools'"),
    ({"functions": [WEATHER], "function_call": "auto", "tool_choice": "auto"}, "function_call", "tool_choice"),
    ({"tools": [{"type": "function", "function": TIME}], "function_call": "none"}, "function_call", "tool_choice"),
    ({"functions": [WEATHER], "function_call": "required"}, "function_call", "\"required\""),
    ({"functions": [WEATHER], "function_call": 3}, "function_call", "must be"),
    ({"functions": [WEATHER], "function_call": {"name": 3}}, "function_call", "must be"),
    ({"functions": [WEATHER], "function_call": {"name": "get_weather", "arguments": "{}"}}, "function_call",
     "must be"),
    ({"functions": [WEATHER], "function_call": {"name": "get_time"}}, "function_call.name", "not in 'functions'"),
    ({"function_call": {"name": "get_weather"}}, "function_call.name", "not in 'functions'"),
    ({"functions": [WEATHER], "function_call": {"name": "get_weather"}, "response_format": {"type": "json_object"}},
     "response_format", "'function_call'"),
    ({"messages": [*MESSAGES, {"role": "function", "content": "sunny"}]}, "messages[1].name", "name of the function"),
    ({"messages": [*MESSAGES, {"role": "function", "name": "", "content": "x"}]}, "messages[1].name",
     "name of the function"),
    ({"messages": [*MESSAGES, {"role": "function", "name": 3, "content": "x"}]}, "messages[1].name",
     "must be a string"),
    ({"messages": [*MESSAGES, {"role": "function", "name": "f", "content": 3}]}, "messages[1].content",
     "must be a string"),
    ({"messages": [*MESSAGES, {"role": "function", "name": "f", "content": "x", "tool_call_id": "c"}]},
     "messages[1]", "does not take"),
    ({"messages": [{"role": "assistant", "function_call": "get_weather"}]}, "messages[0].function_call",
     "must be"),
    ({"messages": [{"role": "assistant", "function_call": {"arguments": "{}"}}]}, "messages[0].function_call.name",
     "name of the function"),
    ({"messages": [{"role": "assistant", "function_call": {"name": "f", "arguments": "[1"}}]},
     "messages[0].function_call.arguments", "JSON object"),
    ({"messages": [{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].function_call", "both"),
    ({"messages": [{"role": "user", "content": "x", "function_call": {"name": "f"}}]}, "messages[0]",
     "does not take"),
])
def test_bad_values_get_a_400_naming_the_field(scripted, fields, param, words):
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        scripted.client.chat.completions.create(**body)
    assert e.value.body["param"] == param and words in e.value.message, e.value.message


def test_functions_on_the_completions_endpoint_get_a_400(scripted):
    with pytest.raises(openai.BadRequestError) as e:
        scripted.client.completions.create(model="default", prompt="x", max_tokens=4,
                                           extra_body={"functions": [WEATHER]})
    assert e.value.body["param"] == "functions"
