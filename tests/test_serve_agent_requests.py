"""Requests shaped as the coding agents' command lines send them (Claude Code 2.1 to ``/v1/messages``,
Codex CLI 0.171 to ``/v1/responses``; their fields, trimmed), against the real Qwen2.5 tokenizer
behind a scripted scheduler: what this server cannot apply is left out, not refused, and a tool
round trip holds. ``tests/test_agent_clis.py`` runs the command lines themselves. Also the
keep-alive of a quiet stream (``conversation.paced``)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from serve_helpers import scripted_server, tokenizer, qwen_dir  # noqa: F401
from speculant.serve.conversation import paced

SCHEMA = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
          "properties": {"file_path": {"description": "The absolute path", "type": "string"},
                         "limit": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9007199254740991}},
          "required": ["file_path"], "additionalProperties": False}
READ_CALL = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "/tmp/notes.txt"}}\n</tool_call>'
LS_CALL = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>'


@pytest.fixture(scope="module")
def scripted(tokenizer):
    s = scripted_server(tokenizer)
    yield s
    s.server.stop()


def _sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]


def _claude_body(messages: list[dict]) -> dict:
    return {
        "model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1;"},
                   {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        "messages": messages,
        "tools": [{"name": "Read", "description": "Reads a file", "input_schema": SCHEMA},
                  {"name": "DeferredToolPlaceholder", "description": "never call this", "defer_loading": True,
                   "input_schema": {"type": "object", "properties": {}}},
                  {"type": "web_search_20250305", "name": "web_search"}],
        "metadata": {"user_id": "{\"session_id\": \"s\"}"}, "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"}, "a_field_of_a_later_version": {"x": 1}}


def test_claude_code_request_and_tool_round_trip(scripted, tokenizer):
    url = scripted.server.url + "/v1/messages?beta=true"
    headers = {"x-api-key": "unused", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    user = {"role": "user", "content": [{"type": "text", "text": "<system-reminder>be kind</system-reminder>"},
                                        {"type": "text", "text": "Read /tmp/notes.txt"}]}
    system_turn = {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /tmp"}]}
    scripted.script["text"] = READ_CALL
    with httpx.stream("POST", url, json=_claude_body([user, system_turn]), headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = _sse(r)
    start = next(e for e in events if e["type"] == "content_block_start")["content_block"]
    assert start["type"] == "tool_use" and start["name"] == "Read"
    arguments = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert json.loads(arguments) == {"file_path": "/tmp/notes.txt"}
    assert next(e for e in events if e["type"] == "message_delta")["delta"]["stop_reason"] == "tool_use"
    prompt = tokenizer.decode(scripted.scheduler.jobs[-1].prompt)
    assert "DeferredToolPlaceholder" in prompt and "web_search" not in prompt
    # the system turn after the request joins the system prompt: one system message, the request last
    assert prompt.count("<|im_start|>system") == 1
    assert prompt.index("You are a coding agent.") < prompt.index("# Environment") < prompt.index("Read /tmp/notes")

    scripted.script["text"] = "It says hello."
    result = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": start["id"], "content": [
            {"type": "text", "text": "1\thello from the file"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
            {"type": "tool_reference", "tool_name": "WebFetch"}]},
        {"type": "text", "text": "go on", "cache_control": {"type": "ephemeral"}}]}
    turns = [user, system_turn, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "", "signature": "sig"},
        {"type": "tool_use", "id": start["id"], "name": "Read", "input": {"file_path": "/tmp/notes.txt"}}]}, result]
    with httpx.stream("POST", url, json=_claude_body(turns), headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = _sse(r)
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text == "It says hello."
    prompt = tokenizer.decode(scripted.scheduler.jobs[-1].prompt)
    assert "hello from the file" in prompt and "image left out" in prompt and "WebFetch" in prompt


def test_claude_code_output_format_is_a_grammar(scripted):
    scripted.script["text"] = '{"answer": 4}'
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "2+2?"}],
            "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    r = scripted.server.post("/v1/messages", body)
    assert r.status_code == 200 and r.json()["content"][0]["text"] == '{"answer": 4}'
    assert scripted.scheduler.jobs[-1].response_format["type"] == "json_schema"
    r = scripted.server.post("/v1/messages", {**body, "output_config": {"format": {"type": "xml"}}})
    assert r.status_code == 400 and "output_config.format" in r.json()["error"]["message"]


def _codex_body(items: list[dict]) -> dict:
    exec_command = {"type": "function", "name": "exec_command", "description": "Runs a command", "strict": False,
                    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                   "required": ["cmd"], "additionalProperties": False}}
    namespace = {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents",
                 "tools": [{"type": "function", "name": "close_agent", "parameters": {"type": "object"}}]}
    developer = {"type": "message", "id": "msg_1", "role": "developer",
                 "content": [{"type": "input_text", "text": "You are a coding agent running in the Codex CLI."}]}
    return {"model": "qwen2.5-coder-1.5b-instruct", "instructions": None, "input": [developer, *items],
            "tools": [exec_command, namespace, {"type": "web_search", "external_web_access": False}],
            "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
            "stream": True, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "session",
            "client_metadata": {"session_id": "session"}, "text": {"verbosity": "medium"}}


def test_codex_request_and_tool_round_trip(scripted, tokenizer):
    url = scripted.server.url + "/v1/responses"
    headers = {"authorization": "Bearer unused", "originator": "codex_exec", "accept": "text/event-stream",
               "x-codex-turn-metadata": "{}", "session-id": "session"}
    user = {"type": "message", "id": "msg_2", "role": "user", "content": [{"type": "input_text", "text": "run ls"}]}
    body = _codex_body([user])
    del body["instructions"]
    scripted.script["text"] = LS_CALL
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = _sse(r)
    call = next(e["item"] for e in events if e["type"] == "response.output_item.done")
    assert call["type"] == "function_call" and call["name"] == "exec_command"
    assert json.loads(call["arguments"]) == {"cmd": "ls"} and events[-1]["type"] == "response.completed"
    prompt = tokenizer.decode(scripted.scheduler.jobs[-1].prompt)
    assert "Codex CLI" in prompt and "exec_command" in prompt and "close_agent" not in prompt
    assert prompt.count("<|im_start|>system") == 1

    scripted.script["text"] = "It printed notes.txt."
    items = [user, {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
             {"type": "function_call", "status": "completed", "id": call["id"], "name": call["name"],
              "arguments": call["arguments"], "call_id": call["call_id"]},
             {"type": "function_call_output", "id": "fco_1", "call_id": call["call_id"],
              "output": [{"type": "input_text", "text": "Process exited with code 0\nOutput:\nnotes.txt\n"},
                         {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]},
             {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}}]
    with httpx.stream("POST", url, json=_codex_body(items), headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = _sse(r)
    assert events[-1]["response"]["output"][-1]["content"][0]["text"] == "It printed notes.txt."
    prompt = tokenizer.decode(scripted.scheduler.jobs[-1].prompt)
    assert "Output:\nnotes.txt" in prompt and "input_image left out" in prompt


def test_a_quiet_stream_is_kept_alive():
    async def slow():
        await asyncio.sleep(0.35)
        yield {"n": 1}
        yield {"n": 2}

    async def take():
        return [chunk async for chunk in paced(slow(), every=0.1)]

    got = asyncio.run(take())
    assert got[0] is None and got[-2:] == [{"n": 1}, {"n": 2}] and set(map(str, got[:-2])) == {"None"}
