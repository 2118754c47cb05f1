"""The agent-facing APIs of ``speculant serve``: Anthropic's Messages (``/v1/messages``,
``count_tokens``) through the real ``anthropic`` client and OpenAI's Responses (``/v1/responses``)
through the real ``openai`` client, against the tiny pair (greedy: a streamed answer adds up to
the non-streamed one), and tool-use round trips with the real Qwen2.5 tokenizer behind a scripted
scheduler (tiny random models write no tool calls). Also /tokenize, /detokenize and the context
length in /v1/models."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from serve_helpers import client, dirs, reference, scripted_server, server, tokenizer, qwen_dir  # noqa: F401

USER = [{"role": "user", "content": "hello there"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city now",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                            "$schema": "http://json-schema.org/draft-07/schema#"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def scripted(tokenizer):
    s = scripted_server(tokenizer)
    yield s
    s.server.stop()


# --- Messages -----------------------------------------------------------------------------------

def test_messages_text_and_stream_agree(claude):
    args = dict(model="claude-sonnet-4-5", max_tokens=12, extra_body={"temperature": 0}, messages=USER,
                system=[{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}])
    message = claude.messages.create(**args)
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == "claude-sonnet-4-5"
    assert message.stop_reason in ("end_turn", "max_tokens") and message.content[0].type == "text"
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 0
    assert message.usage.output_tokens <= 12
    with claude.messages.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.content[0].text == message.content[0].text
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == message.usage.output_tokens


def test_messages_stream_raw_events(server):
    body = {"model": "m", "max_tokens": 8, "temperature": 0, "messages": USER, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    data = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == names


def test_messages_count_tokens_is_the_chat_prompt(claude, server, reference):
    system = "you are terse"
    counted = claude.messages.count_tokens(model="any", system=system, messages=USER)
    text = reference.tokenizer.apply_chat_template([{"role": "system", "content": system}] + USER, tokenize=False,
                                                   add_generation_prompt=True)
    assert counted.input_tokens == len(reference.tokenizer(text, add_special_tokens=False).input_ids)


def test_messages_errors_in_anthropic_shape(claude, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="m", max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AA=="}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in e.value.body["error"]["message"]
    r = server.post("/v1/messages", {"model": "m", "messages": USER})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = server.post("/v1/messages", {"model": "m", "max_tokens": 5, "messages": USER, "output_config": [1]})
    assert r.status_code == 400 and r.json()["type"] == "error" and "output_config" in r.json()["error"]["message"]
    r = server.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_messages_context_overflow_names_both_numbers(server):
    long = " ".join(["word"] * 5000)
    r = server.post("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "context" in r.json()["error"]["message"]


def test_messages_max_tokens_is_a_cap(claude):
    message = claude.messages.create(model="m", max_tokens=10**6, messages=USER, extra_body={"temperature": 0})
    assert message.stop_reason in ("end_turn", "max_tokens")


def test_messages_tool_use_round_trip(scripted, tokenizer):
    client = anthropic.Anthropic(base_url=scripted.server.url, api_key="k", max_retries=0, timeout=60)
    scripted.script["text"] = CALL
    message = client.messages.create(model="claude-sonnet-4-5", max_tokens=100, messages=USER, tools=[WEATHER],
                                     tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert message.stop_reason == "tool_use"
    use = message.content[-1]
    assert use.type == "tool_use" and use.id.startswith("toolu_") and use.name == "get_weather"
    assert use.input == {"city": "Paris"}
    with client.messages.stream(model="m", max_tokens=100, messages=USER, tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    assert final.content[-1].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    scripted.script["text"] = "It is sunny in Paris."
    turns = USER + [{"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                                      {"type": "tool_use", "id": use.id, "name": use.name,
                                                       "input": use.input}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]
    answer = client.messages.create(model="m", max_tokens=100, messages=turns, tools=[WEATHER])
    assert answer.content[0].text == "It is sunny in Paris." and answer.stop_reason == "end_turn"
    prompt = tokenizer.decode(scripted.scheduler.jobs[-1].prompt)
    assert "sunny, 21 C" in prompt and '"city": "Paris"' in prompt and "get_weather" in prompt


def test_messages_stop_sequence(scripted):
    client = anthropic.Anthropic(base_url=scripted.server.url, api_key="k", max_retries=0, timeout=60)
    scripted.script.update(text="one two three", reason="stop")
    message = client.messages.create(model="m", max_tokens=100, messages=USER, stop_sequences=["three"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "three"
    scripted.script.update(reason="eos")


# --- Responses ----------------------------------------------------------------------------------

def test_responses_text_stream_and_chaining(client):
    r = client.responses.create(model="gpt-5", input="hello there", max_output_tokens=12, temperature=0, store=True)
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = list(client.responses.create(model="gpt-5", input="hello there", max_output_tokens=12, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text
    later = client.responses.create(model="gpt-5", input="and more", max_output_tokens=4, temperature=0,
                                    previous_response_id=r.id)
    assert later.usage.input_tokens > r.usage.input_tokens
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-5", input="x", previous_response_id="resp_nope")
    assert "previous_response_id" in e.value.message


def test_responses_refusals(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="x", tools=[{"name": "f"}])
    assert e.value.body["param"] == "tools[0]"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x/y.png"}]}])


def test_responses_function_call_round_trip(scripted, tokenizer):
    client = scripted.client
    tool = {"type": "function", "name": "get_weather", "description": "weather",
            "parameters": WEATHER["input_schema"]}
    scripted.script["text"] = CALL
    r = client.responses.create(model="m", input="Weather in Paris?", tools=[tool], instructions="be brief")
    call = r.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    events = list(client.responses.create(model="m", input="Weather in Paris?", tools=[tool], stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert events[-1].response.output[-1].arguments == call.arguments
    scripted.script["text"] = "Sunny."
    r2 = client.responses.create(model="m", tools=[tool], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert r2.output_text == "Sunny."
    assert "sunny, 21 C" in tokenizer.decode(scripted.scheduler.jobs[-1].prompt)


# --- what agents ask first ----------------------------------------------------------------------

def test_tokenize_detokenize_and_context(server, reference):
    r = server.post("/tokenize", {"content": "hello world"})
    ids = reference.tokenizer("hello world", add_special_tokens=False).input_ids
    assert r.json() == {"tokens": ids}
    pieces = server.post("/tokenize", {"content": "hello world", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert server.post("/detokenize", {"tokens": ids}).json() == {"content": reference.tokenizer.decode(ids)}
    assert server.post("/detokenize", {"tokens": [10**9]}).status_code == 400
    entry = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert entry["context_length"] == entry["max_model_len"] == reference.max_length


# --- the request adapters, without a server -------------------------------------------------------

def test_messages_request_as_chat():
    from speculant.serve.anthropic import chat_body

    body = {"model": "claude-sonnet-4-5", "max_tokens": 50, "system": "sys", "stop_sequences": ["END"],
            "metadata": {"user_id": "u"}, "tools": [dict(WEATHER, cache_control={"type": "ephemeral"})],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                            "input": {"city": "Paris"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": "boom", "is_error": True},
                                                      {"type": "text", "text": "and?"}]}]}
    chat, stops = chat_body(body, "served", lambda on: {} if on is None else {"chat_template_kwargs": {"x": on}})
    assert stops == ["END"] and chat["model"] == "served" and chat["stop"] == ["END"]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]
    assert chat["chat_template_kwargs"] == {"x": False}
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert chat["messages"][2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: boom"}


def test_responses_input_as_chat():
    from speculant.serve.openai_responses import input_messages

    messages = input_messages([
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"role": "user", "content": "go"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"}])
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool"]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}
