"""The agent loop of ``tools/agent_loop.py`` through the ``openai`` client against a server on the
default model: two tool round trips (``get_capital``, then ``get_weather`` with the city the first
tool returned) and a final answer, streamed and not."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import openai
import pytest

from serve_helpers import RunningServer

pytestmark = [pytest.mark.real, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "agent_loop.py"


def _agent_loop():
    spec = importlib.util.spec_from_file_location("agent_loop", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def client():
    from speculant import SpeculativeDecoder
    from speculant.cli.commands import DEFAULT_TARGET
    from speculant.store.models import resolve

    try:
        resolve(DEFAULT_TARGET)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the default model is not available here: {e}")
    server = RunningServer(SpeculativeDecoder(DEFAULT_TARGET))
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    server.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_two_tool_round_trips_and_an_answer(client, stream):
    agent = _agent_loop()
    lines: list[str] = []
    summary = agent.run_agent(client, stream=stream, max_turns=4, max_tokens=64, say=lines.append)
    assert summary["round_trips"] == 2, lines
    capital, weather = summary["calls"]
    assert (capital["turn"], capital["name"], weather["turn"], weather["name"]) == (1, "get_capital", 2, "get_weather")
    assert json.loads(capital["arguments"]) == {"country": "France"}
    city = json.loads(capital["result"])["capital"]
    assert json.loads(weather["arguments"]) == {"city": city}
    assert "error" not in json.loads(weather["result"])
    assert summary["finished"] and summary["final"].strip(), lines
    final = summary["final"].lower()
    assert "rain" in final or "14" in final, summary["final"]  # the answer uses get_weather's result
    assert [t["finish_reason"] for t in summary["turns"]] == ["tool_calls", "tool_calls", "stop"]
    assert all(t["speculative"]["target_calls"] >= 1 for t in summary["turns"])
    assert lines[0].startswith("user: ") and "answer (stop)" in lines[-1]
