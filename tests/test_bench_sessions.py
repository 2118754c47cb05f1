"""``speculant bench --sessions``: the sessions file's loader (every bad field named with its line),
the shipped file (each kind, its sizes), each turn's history (the server's answers as the
assistant's turns, tool calls with their results), the streamed answer's parsing (usage, cached
tokens, tool-call deltas) against a scripted HTTP server, the summary's arithmetic, the rows and
the CLI's checks, and one end-to-end run against a real ``speculant serve`` on a tiny model (``slow``)."""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from speculant.bench.sessions import (TOOL_RESULT, Answer, KINDS, Session, load_sessions, select_sessions,
                                      sessions_path, turn_messages)
from speculant.bench.sessions_report import format_tables, summarize
from speculant.bench.sessions_run import (DEFAULT_ROWS, SessionsBenchConfig, parse_row, request_body,
                                          run_sessions_bench, stream_turn)
from speculant.errors import ConfigError

GOOD = {"id": "s1", "kind": "chat", "system": "Be brief.", "tools": None, "turns": ["hi", "and then?"],
        "source": "written for the test", "licence": "Apache-2.0"}
TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}


def write(tmp_path: Path, *objs, raw: str | None = None) -> Path:
    path = tmp_path / "sessions.jsonl"
    path.write_text(raw if raw is not None else "".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
    return path


# --- the loader --------------------------------------------------------------------------------

def test_a_good_file_loads_with_every_field(tmp_path):
    agent = {**GOOD, "id": "s2", "kind": "agent", "system": None, "tools": [TOOL]}
    got = load_sessions(write(tmp_path, GOOD, agent))
    assert got[0] == Session("s1", "chat", "Be brief.", None, ("hi", "and then?"), "written for the test", "Apache-2.0")
    assert got[1].system is None and got[1].tools == (TOOL,) and got[1].kind == "agent"


@pytest.mark.parametrize("change, message", [
    ({"kind": "essay"}, "field 'kind' is \"essay\"; use one of chat, coding, agent, mt_bench"),
    ({"id": ""}, "field 'id' must be a non-empty string, got an empty string"),
    ({"id": 7}, "field 'id' must be a non-empty string, got a number"),
    ({"system": ""}, "field 'system' must be a non-empty string or null"),
    ({"turns": []}, "field 'turns' must be a non-empty list of the user's messages, got an empty list"),
    ({"turns": "hi"}, "field 'turns' must be a non-empty list"),
    ({"turns": ["hi", None]}, "field 'turns[1]' must be a non-empty string, got null"),
    ({"source": None}, "field 'source' must be a non-empty string, got null"),
    ({"licence": "  "}, "field 'licence' must be a non-empty string"),
    ({"tools": []}, "field 'tools' must be null or a non-empty list"),
    ({"tools": [{"type": "function"}]}, "field 'tools[0]' must be {\"type\": \"function\""),
    ({"tools": [{"type": "function", "function": {"name": "read file"}}]}, "tools[0]'.function.name must be 1-64"),
    ({"tools": [TOOL, TOOL]}, "field 'tools[1]'.function.name 'read_file' is used by an earlier tool"),
    ({"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]}, "function has 'params'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "parameters must be a JSON schema object"),
    ({"extra": 1}, "field 'extra' is not a session field"),
])
def test_each_bad_field_names_its_line_and_field(tmp_path, change, message):
    path = write(tmp_path, GOOD, {**GOOD, "id": "s2", **change})
    with pytest.raises(ConfigError) as e:
        load_sessions(path)
    assert f"{path}:2: " in str(e.value) and message in str(e.value)


def test_file_level_problems(tmp_path):
    missing = {k: v for k, v in GOOD.items() if k != "turns"}
    for objs, raw, message in [((missing,), None, ":1: field 'turns' is missing"),
                               ((), "{not json\n", ":1: not JSON"), ((), "[1]\n", ":1: a session is a JSON object"),
                               ((), "\n\n", "no sessions in the file"),
                               ((GOOD, GOOD), None, ":2: field 'id': 's1' is the id of line 1 too")]:
        with pytest.raises(ConfigError, match=message):
            load_sessions(write(tmp_path, *objs, raw=raw))
    with pytest.raises(ConfigError, match="no such file"):
        load_sessions(tmp_path / "none.jsonl")
    with pytest.raises(ConfigError, match="is a directory"):
        load_sessions(tmp_path)


def test_select_by_kind_and_limit(tmp_path):
    sessions = load_sessions(write(tmp_path, GOOD, {**GOOD, "id": "c", "kind": "coding"}, {**GOOD, "id": "d"}))
    assert [s.id for s in select_sessions(sessions, ("chat",))] == ["s1", "d"]
    assert [s.id for s in select_sessions(sessions, None, 2)] == ["s1", "c"]
    with pytest.raises(ConfigError, match="unknown kind 'code'"):
        select_sessions(sessions, ("code",))
    with pytest.raises(ConfigError, match="no session of that kind"):
        select_sessions(sessions, ("agent",))
    with pytest.raises(ConfigError, match="--limit must be >= 1"):
        select_sessions(sessions, None, 0)


# --- the shipped file --------------------------------------------------------------------------

def _coding_session() -> Session:
    return next(s for s in load_sessions("default") if s.kind == "coding")


def test_the_shipped_file_has_every_kind_at_its_stated_size():
    path = sessions_path("default")
    assert path.stat().st_size < 64 * 1024  # tens of KB
    sessions = load_sessions("default")
    by_kind = {k: [s for s in sessions if s.kind == k] for k in KINDS}
    assert all(by_kind.values()), {k: len(v) for k, v in by_kind.items()}
    coding = by_kind["coding"][0]
    assert len(coding.turns) == 5 and "class LLGuidanceEngine" in coding.system
    assert 2000 <= len(coding.system) / 4 <= 3500  # about 4 characters a token; the tokenizer's count: below
    assert any(len(s.turns) == 6 for s in by_kind["chat"]) and all("MIT" in s.licence for s in by_kind["chat"])
    assert all(len(s.turns) == 2 for s in by_kind["mt_bench"])
    agent = by_kind["agent"][0]
    names = {t["function"]["name"] for t in agent.tools}
    assert {"read_file", "write_file", "run_shell", "search_code"} <= names and agent.system and len(agent.turns) >= 4
    assert all(s.source and s.licence for s in sessions)


@pytest.mark.real
def test_the_coding_session_s_system_prompt_in_the_default_tokenizer_s_tokens():
    from transformers import AutoTokenizer

    from speculant.store.models import resolve
    from speculant.store.presets import DEFAULT_TARGET

    tokenizer = AutoTokenizer.from_pretrained(str(resolve(DEFAULT_TARGET)))
    assert 2000 <= len(tokenizer(_coding_session().system)["input_ids"]) <= 3500


def test_the_shipped_mt_bench_turns_are_spec_bench_s():
    from speculant.specbench import load_questions

    questions = {q["question_id"]: q["turns"] for q in load_questions()}
    for s in load_sessions("default"):
        if s.kind == "mt_bench":
            assert list(s.turns) == questions[int(s.id.rsplit("-", 1)[1])]


# --- each turn's history -----------------------------------------------------------------------

def test_each_turn_resends_the_history_with_the_server_s_answers():
    s = Session("s", "chat", "Be brief.", None, ("one", "two", "three"), "x", "y")
    assert turn_messages(s, []) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one"}]
    got = turn_messages(s, [Answer("first answer"), Answer("second answer")])
    assert got == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one"},
                   {"role": "assistant", "content": "first answer"}, {"role": "user", "content": "two"},
                   {"role": "assistant", "content": "second answer"}, {"role": "user", "content": "three"}]
    no_system = Session("s", "chat", None, None, ("one", "two"), "x", "y")
    assert turn_messages(no_system, [])[0] == {"role": "user", "content": "one"}
    with pytest.raises(ValueError, match="there is no turn 3"):
        turn_messages(no_system, [Answer("a"), Answer("b")])


def test_a_tool_call_answer_is_followed_by_its_results():
    s = Session("a", "agent", "Agent.", (TOOL,), ("read it", "it says 42"), "x", "y")
    call = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
    got = turn_messages(s, [Answer("", (call,))])
    assert got[2] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert got[3] == {"role": "tool", "tool_call_id": "call_1", "content": TOOL_RESULT}
    assert got[4] == {"role": "user", "content": "it says 42"}
    body = request_body(parse_row("ar"), s, [], 16)
    assert body["tools"] == [TOOL] and body["max_tokens"] == 16 and body["temperature"] == 0 and body["stream"]
    assert "cache_prompt" not in body  # speculant serve's default is true
    assert request_body(parse_row("llama-server"), s, [], 16)["cache_prompt"] is True


# --- a streamed answer -------------------------------------------------------------------------

class _Scripted(BaseHTTPRequestHandler):
    chunks: list[dict] = []
    bodies: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        type(self).bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for c in self.chunks:
            self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _delta(**d):
    return {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}


def test_a_stream_gives_text_usage_and_cached_tokens(scripted):
    server, url = scripted
    _Scripted.chunks = [_delta(role="assistant"), _delta(content="Hel"), _delta(content="lo"),
                        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                        {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 2,
                                                  "prompt_tokens_details": {"cached_tokens": 24}}}]
    r = stream_turn(url, {"messages": []})
    assert (r["text"], r["completion_tokens"], r["tokens_from"], r["prompt_tokens"]) == ("Hello", 2, "usage", 30)
    assert (r["cached_tokens"], r["cached_from"], r["finish_reason"]) == (24, "usage", "stop")
    assert 0 < r["ttft_s"] <= r["wall_s"]
    _Scripted.chunks = [_delta(content="a"), _delta(content="b"), {"choices": [], "timings": {"cache_n": 7}}]
    r = stream_turn(url, {"messages": []})  # no usage chunk: one token a chunk; llama-server's cache_n
    assert (r["completion_tokens"], r["tokens_from"], r["cached_tokens"], r["cached_from"]) == (2, "chunks", 7, "timings")
    _Scripted.chunks = [_delta(content="a")]
    assert stream_turn(url, {"messages": []})["cached_tokens"] is None


def test_streamed_tool_call_deltas_add_up_to_the_call(scripted):
    server, url = scripted
    _Scripted.chunks = [
        _delta(tool_calls=[{"index": 0, "id": "call_x", "type": "function",
                            "function": {"name": "read_file", "arguments": ""}}]),
        _delta(tool_calls=[{"index": 0, "function": {"arguments": '{"path": '}}]),
        _delta(tool_calls=[{"index": 0, "function": {"arguments": '"a.py"}'}}]),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}]
    r = stream_turn(url, {"messages": []})
    assert r["text"] == "" and r["finish_reason"] == "tool_calls"
    assert r["tool_calls"] == [{"id": "call_x", "type": "function",
                                "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]


# --- the summary -------------------------------------------------------------------------------

def _turn(k, wall, ttft, tokens, text="t", prompt=100, cached=None):
    return {"turn": k, "wall_s": wall, "ttft_s": ttft, "completion_tokens": tokens, "text": text, "tool_calls": [],
            "prompt_tokens": prompt, "cached_tokens": cached}


def _result(rows: dict) -> dict:
    return {"sessions_file": {"sessions": [{"id": "a", "kind": "chat", "turns": 2},
                                           {"id": "b", "kind": "coding", "turns": 1}]},
            "rows": {n: {"sessions": s} for n, s in rows.items()}, "skipped": {}, "failed": {}}


def test_the_summary_adds_up_turns_and_compares_with_the_best_peer():
    ar = [{"id": "a", "error": None, "turns": [_turn(1, 2.0, 0.5, 20), _turn(2, 2.0, 0.1, 20, prompt=200, cached=100)]},
          {"id": "b", "error": None, "turns": [_turn(1, 4.0, 1.0, 40, prompt=300, cached=0)]}]
    auto = copy.deepcopy(ar)
    for s in auto:
        for t in s["turns"]:
            t["wall_s"] /= 2
    slow = copy.deepcopy(ar)
    for s in slow:
        for t in s["turns"]:
            t["wall_s"] *= 2
    slow[1]["turns"][0]["text"] = "other"
    fast = copy.deepcopy(ar)  # the best peer: as fast as ar
    result = _result({"auto": auto, "ar": ar, "llama-server": slow, "llama-server+ngram-mod": fast})
    s = summarize(result)
    assert s["compared"] == ["a", "b"] and s["left_out"] == {} and s["best_peer"] == "llama-server+ngram-mod"
    r = s["rows"]
    assert r["ar"]["seconds"] == 8.0 and r["ar"]["completion_tokens"] == 80 and r["ar"]["tok_s"] == 10.0
    assert r["ar"]["ttft_median_s"] == 0.5 and r["ar"]["ttft_first_median_s"] == 0.75
    assert r["ar"]["ttft_later_median_s"] == 0.1
    assert r["ar"]["cached_tokens"] == 100 and r["ar"]["cached_share"] == 100 / 500 and r["ar"]["prompt_tokens"] == 600
    assert r["ar"]["per_session"]["a"] == {"seconds": 4.0, "tok_s": 10.0, "ttft_s": [0.5, 0.1]}
    vs = r["auto"]["vs_best_peer"]
    assert vs["peer"] == "llama-server+ngram-mod" and vs["tok_s"] == 2.0 and vs["seconds"] == 2.0
    assert vs["ttft"] == 1.0 and vs["per_session"] == {"a": 2.0, "b": 2.0}
    assert r["auto"]["same_as_plain"] == [3, 3] and r["ar"]["same_as_plain"] is None
    assert r["llama-server+ngram-mod"]["same_as_plain"] == [2, 3] and r["llama-server"]["same_as_plain"] is None
    assert r["llama-server"]["vs_best_peer"] is None and r["llama-server"]["cached_share"] == 0.2
    title, head, body = format_tables({**result, "summary": s})[0]
    assert [row[0] for row in body] == ["auto", "ar", "llama-server", "llama-server+ngram-mod"]
    assert body[0][7] == "2.00x" and body[3][7] == "1.00x" and body[0][8] == "3/3"


def test_a_session_that_failed_in_one_row_is_left_out_of_every_row():
    ok = [{"id": "a", "error": None, "turns": [_turn(1, 1.0, 0.1, 10)]},
          {"id": "b", "error": None, "turns": [_turn(1, 1.0, 0.1, 10)]}]
    broken = [ok[0], {"id": "b", "error": "turn 1: HTTP 400: too long", "turns": []}]
    s = summarize(_result({"ar": ok, "llama-server": broken}))
    assert s["compared"] == ["a"] and s["left_out"] == {"b": "llama-server: turn 1: HTTP 400: too long"}
    assert s["rows"]["ar"]["turns"] == 1 and s["rows"]["ar"]["vs_best_peer"]["tok_s"] == 1.0
    assert summarize(_result({"ar": ok}))["rows"]["ar"]["vs_best_peer"] is None  # no peer ran


# --- the rows, the config and the CLI ----------------------------------------------------------

def test_rows_and_their_options():
    assert parse_row("auto").options == () and not parse_row("auto").peer
    assert parse_row("llama-server+ngram-mod@cache-reuse=0@cache-ram=512").options == (("cache-ram", 512),
                                                                                       ("cache-reuse", 0))
    assert parse_row("auto@cache-ram=0").option("cache-ram") == 0
    for text, message in [("openvino", "not a server"), ("turbo", "not a row of bench --sessions"),
                          ("auto@cache-reuse=1", "llama-server rows only"), ("ar@big=1", "unknown option @big"),
                          ("ar@cache-ram=-1", "whole number"), ("ar@cache-ram", "whole number")]:
        with pytest.raises(ConfigError, match=message):
            parse_row(text)
    with pytest.raises(ConfigError, match="twice"):
        SessionsBenchConfig(rows=("ar", "ar"))
    with pytest.raises(ConfigError, match="--max-new-tokens"):
        SessionsBenchConfig(max_new_tokens=0)
    with pytest.raises(ConfigError, match="no such file"):
        SessionsBenchConfig(sessions="/nonexistent/s.jsonl")


def test_the_cli_s_defaults_and_checks(tmp_path):
    from speculant.cli.commands import SESSION_ROWS, _changed_decoder_args, build_parser, main

    assert SESSION_ROWS == DEFAULT_ROWS
    args = build_parser().parse_args(["bench", "--sessions", "default", "--target-quant", "int4", "--no-pacing",
                                      "--quant-head", "--gamma", "3", "--target", "x"])
    assert _changed_decoder_args(args, skip=("target",)) == ("--gamma", "3", "--target-quant", "int4", "--quant-head",
                                                             "--no-pacing")
    assert main(["bench", "--sessions", "default", "--temperature", "0.5"]) == 2
    assert main(["bench", "--limit", "2"]) == 2
    assert main(["bench", "--sessions", str(tmp_path / "none.jsonl")]) == 2


# --- end to end --------------------------------------------------------------------------------

@pytest.mark.slow
def test_one_session_against_a_real_speculant_serve(tmp_path):
    """``speculant serve`` on a tiny model in a child process plays a two-turn session; the
    llama-server row is skipped with its reason (not installed in the tests' cache, and the tiny
    model has no GGUF file)."""
    from transformers import AutoTokenizer

    from serve_helpers import CHAT_TEMPLATE
    from tiny import tiny_model_dir

    target = tiny_model_dir(tmp_path / "target", seed=0)
    tok = AutoTokenizer.from_pretrained(str(target))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(target))
    path = write(tmp_path, {**GOOD, "system": "w1 w2", "turns": ["w3 w4 w5", "w6 w7"]})
    cfg = SessionsBenchConfig(sessions=str(path), rows=("ar", "llama-server"), max_new_tokens=6, target=str(target),
                              serve_args=("--dtype", "float32"), startup_timeout=300, json_out=str(tmp_path / "r.json"))
    logs: list[str] = []
    result = run_sessions_bench(cfg, command="speculant bench --sessions test", log=logs.append)
    assert "llama-server" in result["skipped"] and not result["failed"]
    played = result["rows"]["ar"]["sessions"][0]
    assert played["error"] is None and [t["turn"] for t in played["turns"]] == [1, 2]
    first, second = played["turns"]
    assert first["messages"] == 2 and second["messages"] == 4  # system, user, the answer, user
    assert first["completion_tokens"] == 6 and first["text"] and second["prompt_tokens"] > first["prompt_tokens"]
    assert result["rows"]["ar"]["server"][:2] == ["speculant", "serve"] and "--method" in result["rows"]["ar"]["server"]
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["kind"] == "bench-sessions" and saved["command"] == "speculant bench --sessions test"
    assert {"cpu", "flags", "family", "model"} <= set(saved["machine"]) and "commit" in saved and "dirty" in saved
    assert saved["summary"]["rows"]["ar"]["turns"] == 2 and saved["sessions_file"]["sha256"]
