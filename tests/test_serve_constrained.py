"""Constrained output through ``speculant serve``: ``response_format`` (json_schema, json_object,
regex) on both endpoints, and ``tool_choice`` "required" / a named function kept by the grammar of
the template's tool calls. A tiny random Qwen2 with the real Qwen2.5 tokenizer and chat template
serves them: a random model writes no tool call and no JSON by itself (the negative control), so
every well-formed call and document below is the grammar's doing, under speculation (lookup)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from speculant.grammars import GrammarSpec, make_engine
from speculant.serve.errors import APIError
from speculant.serve.schema import parse_request
from speculant.serve.tools import call_grammar, parse

from serve_helpers import tiny_qwen_server
from serve_helpers import qwen_dir, tokenizer  # noqa: F401 (the fixtures)

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                            "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}
SCHEMAS = {"get_weather": CITY, "get_time": TIME["function"]["parameters"]}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}


@pytest.fixture(scope="module")
def served(tmp_path_factory, qwen_dir, tokenizer):
    server = tiny_qwen_server(tmp_path_factory.mktemp("constrained-serve") / "target", qwen_dir, tokenizer,
                              tmp_path_factory.mktemp("cache"))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield client
    server.stop()


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def _valid(calls: list[tuple[str, dict]]) -> bool:
    for name, args in calls:
        jsonschema.validate(args, SCHEMAS[name])
    return bool(calls)


# --- the grammar of the calls ------------------------------------------------------------------

def test_the_call_grammar_takes_the_calls_the_choice_allows_and_no_others(tokenizer):
    engine = make_engine("llguidance", tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    time = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    texts = {"weather": weather, "time": time, "both": weather + "\n" + time,
             "other city": weather.replace("Paris", "Oslo"), "unknown tool": time.replace("get_time", "get_date"),
             "extra argument": weather.replace('"Paris"', '"Paris", "when": 1'), "no tag": weather[11:],
             "text first": "Sure. " + weather}

    def allowed(grammar: str) -> set[str]:
        compiled = engine.compile(GrammarSpec("grammar", grammar))
        out = set()
        for name, text in texts.items():
            m = compiled.matcher()
            if all(m.advance(t) for t in tokenizer(text, add_special_tokens=False).input_ids) and m.can_end():
                out.add(name)
        return out

    assert allowed(call_grammar((WEATHER, TIME), tokenizer)) == {"weather", "time", "both"}
    assert allowed(call_grammar((WEATHER, TIME), tokenizer, parallel=False)) == {"weather", "time"}
    assert allowed(call_grammar((WEATHER, TIME), tokenizer, name="get_time")) == {"time"}
    assert all(parse(texts[k])[1] for k in ("weather", "time", "both"))  # what the grammar allows parses


def test_request_checks():
    base = {"model": "default", "messages": MESSAGES}
    req = parse_request({**base, "tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False},
                        "chat")
    assert (req.tool_choice, req.tool_name, req.parallel_tool_calls) == ("required", None, False)
    req = parse_request({**base, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                      "function": {"name": "get_weather"}}}, "chat")
    assert (req.tool_choice, req.tool_name) == ("function", "get_weather")
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    assert parse_request({**base, "response_format": rf}, "chat").response_format == rf
    assert parse_request({**base, "response_format": {"type": "text"}}, "chat").response_format is None
    assert parse_request({"model": "default", "prompt": "x", "response_format": rf}, "completion").response_format == rf
    for fields, param, words in [
            ({"response_format": {"type": "yaml"}}, "response_format", "type must be one of"),
            ({"response_format": {"type": "json_schema"}}, "response_format", "needs \"json_schema\""),
            ({"response_format": {"type": "regex", "regex": ""}}, "response_format", "non-empty string"),
            ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
             "response_format", "cannot be combined"),
            ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
            ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
            ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather", "x": 1}}},
             "tool_choice", "must be")]:
        with pytest.raises(APIError) as e:
            parse_request({**base, **fields}, "chat")
        assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


# --- end to end --------------------------------------------------------------------------------

def test_tool_choice_auto_leaves_the_random_model_writing_text(served):
    reply = served.chat.completions.create(model="default", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=24,
                                           temperature=0)
    assert not reply.choices[0].message.tool_calls and reply.choices[0].finish_reason == "length"


def test_a_named_function_is_called(served):
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = served.chat.completions.create(model="default", messages=MESSAGES, tools=[WEATHER, TIME],
                                           tool_choice=named, max_tokens=64, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = _calls(choice.message)
    assert [n for n, _ in calls] == ["get_weather"] and _valid(calls)
    chunks = list(served.chat.completions.create(model="default", messages=MESSAGES, tools=[WEATHER, TIME],
                                                 tool_choice=named, max_tokens=64, temperature=0, stream=True))
    streamed = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or ():
            streamed.setdefault(d.index, ["", ""])
            streamed[d.index][0] += d.function.name or ""
            streamed[d.index][1] += d.function.arguments or ""
    assert [(n, json.loads(a)) for n, a in streamed.values()] == calls
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("parallel", [False, True])
def test_required_makes_at_least_one_call(served, parallel):
    for seed in range(3):
        reply = served.chat.completions.create(model="default", messages=MESSAGES, tools=[WEATHER, TIME],
                                               tool_choice="required", parallel_tool_calls=parallel,
                                               max_tokens=96, temperature=1.0, seed=seed)
        calls = _calls(reply.choices[0].message)
        assert _valid(calls)
        if not parallel:
            assert len(calls) == 1 and reply.choices[0].finish_reason == "tool_calls"


def test_response_format_on_both_endpoints(served):
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    plain = served.chat.completions.create(model="default", messages=MESSAGES, max_tokens=24, temperature=0)
    with pytest.raises(ValueError):
        json.loads(plain.choices[0].message.content)
    reply = served.chat.completions.create(model="default", messages=MESSAGES, max_tokens=48, temperature=0,
                                           response_format=rf)
    jsonschema.validate(json.loads(reply.choices[0].message.content), ANSWER)
    assert reply.choices[0].finish_reason == "stop"
    text = served.completions.create(model="default", prompt="Pets:", max_tokens=16, temperature=0.8, seed=1,
                                     extra_body={"response_format": {"type": "regex", "regex": "(cat|dog)s? [0-9]"}})
    assert re.fullmatch("(cat|dog)s? [0-9]", text.choices[0].text)
    with pytest.raises(openai.BadRequestError) as e:  # a grammar that does not compile: refused at the start
        served.chat.completions.create(model="default", messages=MESSAGES, max_tokens=8,
                                       response_format={"type": "regex", "regex": "(("})
    assert "regex" in e.value.message
    after = served.chat.completions.create(model="default", messages=MESSAGES, max_tokens=4, temperature=0)
    assert after.choices[0].finish_reason == "length"  # the server goes on
