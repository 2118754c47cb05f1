"""A tool-calling agent loop through the ``openai`` client against ``speculant serve``.

The user asks something that takes two tools in sequence: the capital of a country
(``get_capital``), then the weather in that city (``get_weather``). Both tools are plain Python
functions here that return JSON. The loop sends the conversation with ``tools``, runs every call
the model returns, appends the assistant's message (with its ``tool_calls``) and one ``tool``
message per call, and asks again, until the model answers without a call (at most ``--max-turns``
requests). Greedy (temperature 0), so a run is reproducible.

Without ``--base-url`` the script starts ``speculant serve`` on the default model
(Qwen2.5-Coder-1.5B-Instruct, the CLI's default, with its default method) on a free loopback
port, waits for ``/health``, and stops it at the end. With ``--stream`` every request is streamed
and the reply is put together from the deltas: ``delta.content`` pieces are joined, and each
``delta.tool_calls`` entry is added to the call at its ``index`` (the first one carries the id and
the name, the later ones pieces of ``arguments``).

``--tool-choice`` sets what the turns that still need a call send; the turn after the last planned
call always sends "auto", so the model answers in its own words:

- ``named`` (the default): ``{"type": "function", "function": {"name": ...}}`` naming the next tool
  of ``PLAN``. The server's constrained decoding holds the output to one well-formed call of that
  tool; the model still chooses the arguments (the city comes from ``get_capital``'s result).
- ``auto``: the model decides on every turn.
- ``required``: one call of any tool (``parallel_tool_calls`` false).

What works on Qwen2.5-Coder-1.5B-Instruct (greedy), streamed or not: ``named``. The model calls
``get_capital`` with ``{"country": "France"}``, ``get_weather`` with ``{"city": "Paris"}``, then
answers in one sentence. With ``auto`` it writes its calls as JSON in a Markdown code block or
as bare JSON instead of the ``<tool_call>`` tags its chat template asks for (Qwen2.5-Coder models
are known to do this); the server reads a completion that is only such calls as calls, but the
model makes one call and then answers (on the default question it writes ``{{...}}}``, no JSON),
so the loop ends with fewer than two round trips. With ``required`` it calls ``get_weather`` twice and never
``get_capital``. The system prompt (``SYSTEM``) is what makes the last turn an answer rather than
one more call written as text.

Prints every turn (the calls with their arguments, the tools' results, the answer) and then a JSON
summary: the tool round trips, the calls, the final text, and the tokens and ``usage.speculative``
of every request. Exits non-zero if fewer than two round trips happened or the model did not give
a final answer within ``--max-turns`` requests.

    python tools/agent_loop.py [--stream] [--tool-choice named|auto|required]
                               [--base-url http://127.0.0.1:8000/v1]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

QUESTION = "What is the weather in the capital of France? Use the tools."
SYSTEM = ("You are a helpful assistant. Use the tools to look up facts; once the tool results answer the "
          "question, answer the user in one sentence.")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_capital", "description": "The capital city of a country.",
        "parameters": {"type": "object", "properties": {"country": {"type": "string", "description": "A country"}},
                       "required": ["country"]}}},
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "A city"}},
                       "required": ["city"]}}},
]
PLAN = ("get_capital", "get_weather")  # the calls the question takes, in order

CAPITALS = {"france": "Paris", "germany": "Berlin", "italy": "Rome", "japan": "Tokyo", "spain": "Madrid"}
WEATHER = {"Paris": ("light rain", 14), "Berlin": ("cloudy", 9), "Rome": ("sunny", 22), "Tokyo": ("clear", 17),
           "Madrid": ("sunny", 25)}


def get_capital(country: str) -> str:
    capital = CAPITALS.get(country.strip().lower())
    if capital is None:
        return json.dumps({"error": f"unknown country {country!r}"})
    return json.dumps({"country": country, "capital": capital})


def get_weather(city: str) -> str:
    if city not in WEATHER:
        return json.dumps({"error": f"no weather for {city!r}"})
    sky, celsius = WEATHER[city]
    return json.dumps({"city": city, "weather": sky, "temperature_c": celsius})


FUNCTIONS: dict[str, Callable[..., str]] = {"get_capital": get_capital, "get_weather": get_weather}


def call_tool(name: str, arguments: str) -> str:
    """Run one call the model made; what goes wrong goes back to the model as a JSON error."""
    if name not in FUNCTIONS:
        return json.dumps({"error": f"no tool named {name!r}"})
    try:
        return FUNCTIONS[name](**json.loads(arguments))
    except (json.JSONDecodeError, TypeError, AttributeError) as e:
        return json.dumps({"error": f"bad arguments {arguments!r}: {e}"})


def tool_choice_for(mode: str, round_trips: int) -> Any:
    """What a turn sends as ``tool_choice`` after ``round_trips`` round trips (module doc)."""
    if round_trips >= len(PLAN):
        return "auto"
    if mode == "named":
        return {"type": "function", "function": {"name": PLAN[round_trips]}}
    return mode


def ask(client, messages: list[dict], tool_choice: Any, *, stream: bool, max_tokens: int, model: str) -> dict:
    """One chat completion: {"content", "tool_calls" (OpenAI's message shape, as dicts),
    "finish_reason", "usage" (a dict, None if the server sent none)}."""
    request: dict[str, Any] = dict(model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                   temperature=0, max_tokens=max_tokens)
    if tool_choice == "required":
        request["parallel_tool_calls"] = False  # exactly one call
    if not stream:
        reply = client.chat.completions.create(**request)
        choice = reply.choices[0]
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                               "arguments": c.function.arguments}}
                 for c in choice.message.tool_calls or ()]
        return {"content": choice.message.content, "tool_calls": calls, "finish_reason": choice.finish_reason,
                "usage": reply.usage.model_dump() if reply.usage else None}
    content, calls, finish, usage = "", {}, None, None
    for chunk in client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:  # the last chunk, with no choices
            usage = chunk.usage.model_dump()
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            if piece.id:
                call["id"] = piece.id
            if piece.function and piece.function.name:
                call["function"]["name"] = piece.function.name
            if piece.function and piece.function.arguments:
                call["function"]["arguments"] += piece.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish,
            "usage": usage}


def run_agent(client, question: str = QUESTION, *, tool_choice: str = "named", stream: bool = False,
              system: str | None = SYSTEM, max_turns: int = 6, max_tokens: int = 256, model: str = "default",
              say: Callable[[str], None] = print) -> dict:
    """The loop (module doc); ``say`` gets each line of the transcript. Returns the summary:
    {"stream", "round_trips", "finished" (the model answered with finish_reason "stop"), "final",
    "calls": [{"turn", "name", "arguments", "result"}], "turns": [per request: "tool_choice",
    "finish_reason", "prompt_tokens", "completion_tokens", "speculative"], "speculative" (all
    requests together, if the server sent ``usage.speculative``)}."""
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    summary: dict[str, Any] = {"stream": stream, "round_trips": 0, "finished": False, "final": None,
                               "calls": [], "turns": []}
    say(f"user: {question}")
    for turn in range(1, max_turns + 1):
        choice = tool_choice_for(tool_choice, summary["round_trips"])
        label = choice if isinstance(choice, str) else choice["function"]["name"]
        reply = ask(client, messages, choice, stream=stream, max_tokens=max_tokens, model=model)
        usage = reply["usage"] or {}
        spec = usage.get("speculative")
        summary["turns"].append({"tool_choice": label, "finish_reason": reply["finish_reason"],
                                 "prompt_tokens": usage.get("prompt_tokens"),
                                 "completion_tokens": usage.get("completion_tokens"),
                                 "speculative": spec and {k: round(v, 3) if isinstance(v, float) else v
                                                          for k, v in spec.items()}})
        head = f"[turn {turn}, tool_choice {label}]"
        if not reply["tool_calls"]:
            summary["final"] = reply["content"]
            summary["finished"] = reply["finish_reason"] == "stop"
            say(f"{head} answer ({reply['finish_reason']}): {reply['content']}")
            break
        if reply["content"]:
            say(f"{head} text: {reply['content']}")
        messages.append({"role": "assistant", "content": reply["content"], "tool_calls": reply["tool_calls"]})
        for call in reply["tool_calls"]:
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            result = call_tool(name, arguments)
            say(f"{head} call {name}({arguments})\n    -> {result}")
            summary["calls"].append({"turn": turn, "name": name, "arguments": arguments, "result": result})
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        summary["round_trips"] += 1
    spec = [t["speculative"] for t in summary["turns"] if t["speculative"]]
    if spec:
        tokens = sum(t["completion_tokens"] or 0 for t in summary["turns"])
        passes = sum(s["target_calls"] for s in spec)
        summary["speculative"] = {"method": spec[0]["method"], "completion_tokens": tokens, "target_calls": passes,
                                  "tokens_per_call": round(tokens / passes, 3) if passes else 0.0}
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None,
                   help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 (default: start "
                        "`speculant serve` on the default model and stop it at the end)")
    p.add_argument("--api-key", default="unused", help="the server's API key, if it was started with one")
    p.add_argument("--model", default="default")
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--stream", action="store_true", help="stream every request and assemble the deltas")
    p.add_argument("--tool-choice", choices=["named", "auto", "required"], default="named",
                   help="what the turns that need a call send (default: %(default)s; see the module doc)")
    p.add_argument("--max-turns", type=int, default=6, help="requests at most (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256, help="per request (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=1800.0,
                   help="seconds for a started server to come up; a first start builds kernels (default: 1800)")
    args = p.parse_args(argv)

    from openai import OpenAI

    server = None
    base_url = args.base_url
    if base_url is None:
        from speculant.bench.serve_bench import SpeculantServer  # `python -m speculant.cli serve` on a free port

        print("starting speculant serve on the default model ...", file=sys.stderr, flush=True)
        server = SpeculantServer(method=None, extra_args=(), startup_timeout=args.startup_timeout).start()
        base_url = server.url + "/v1"
    try:
        client = OpenAI(base_url=base_url, api_key=args.api_key, max_retries=0, timeout=600)
        summary = run_agent(client, args.question, tool_choice=args.tool_choice, stream=args.stream,
                            max_turns=args.max_turns, max_tokens=args.max_tokens, model=args.model)
    finally:
        if server is not None:
            server.close()
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    ok = summary["round_trips"] >= 2 and summary["finished"]
    if not ok:
        print(f"agent loop failed: {summary['round_trips']} tool round trips, "
              f"{'an answer' if summary['finished'] else 'no final answer'}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
