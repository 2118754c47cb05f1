"""The coding agents' own command lines against ``speculant serve`` on the default model: Codex CLI
(``codex exec``, a ``model_providers`` entry with ``wire_api = "responses"``: ``/v1/responses``) and
Claude Code (``claude -p`` with ``ANTHROPIC_BASE_URL``: ``/v1/messages``), as docs/serve.md
configures them. For each, a one-line request ends with exit status 0 and the model's answer
printed, and a request that has it call a tool completes the round trip: the call is run by the
CLI, the request carrying its result gets a 200 and an answer (what the model makes of the
result is its own affair). ``make install-agents`` installs the pinned CLIs; a test skips when its
CLI is not on PATH. Each CLI runs with its own temporary home (nothing global is read or written),
a dummy key, and telemetry and update checks off. The prompts are long (Codex CLI's about 6k
tokens, Claude Code's about 11k), so a first prefill on a CPU takes a minute or more."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import speculant
from serve_helpers import free_port, wait_healthy

pytestmark = [pytest.mark.real, pytest.mark.slow]

CLI_TIMEOUT = 900  # seconds for one CLI run (a few requests with a long prompt each)
MARKER = "speculant-marker-42"  # the file the tool round trips look at holds this
QUIET = {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
         "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "NO_COLOR": "1"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``speculant serve`` (default model) in a subprocess on a free loopback port: its base URL."""
    from speculant.cli.commands import DEFAULT_TARGET
    from speculant.store.models import resolve

    if os.environ.get("SPECULANT_AGENT_CLIS") != "1":
        pytest.skip("the agent command lines take ~10 minutes and the model may not call the tool: "
                    "run them with `make test-agents` (SPECULANT_AGENT_CLIS=1)")
    if shutil.which("codex") is None and shutil.which("claude") is None:
        pytest.skip("neither codex nor claude is on PATH (make install-agents)")
    try:
        resolve(DEFAULT_TARGET)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the default model is not available here: {e}")
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    src = str(Path(speculant.__file__).resolve().parents[1])  # the code under test, in the subprocess too
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "speculant.cli", "serve", "--port", str(port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=err, text=True)
    url = f"http://127.0.0.1:{port}"
    proc.stderr = open(log)  # what wait_healthy shows if the server exits
    try:
        wait_healthy(proc, url, timeout=900)
        yield url
    finally:
        proc.stderr.close()
        proc.terminate()
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def requests(url: str, endpoint: str) -> dict[str, float]:
    """The server's request counts of ``endpoint`` by status (its /metrics)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'speculant_requests_total\{endpoint="([^"]+)",[^}]*status="(\d+)"\} (\S+)', line)
        if m and m.group(1) == endpoint:
            out[m.group(2)] = out.get(m.group(2), 0) + float(m.group(3))
    return out


def _run(argv: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT)


# --- Codex CLI ----------------------------------------------------------------------------------

def _codex(url: str, home: Path) -> tuple[list[str], dict]:
    if shutil.which("codex") is None:
        pytest.skip("codex is not on PATH (make install-agents)")
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(f'''model = "qwen2.5-coder-1.5b-instruct"
model_provider = "speculant"

[model_providers.speculant]
name = "speculant"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "SPECULANT_API_KEY"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 900000
''')
    env = dict(os.environ, **QUIET, CODEX_HOME=str(home), HOME=str(home), SPECULANT_API_KEY="unused")
    return ["codex", "exec", "--skip-git-repo-check", "--ephemeral", "--json"], env


def _events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_codex_exec_answers(served, tmp_path):
    argv, env = _codex(served, tmp_path / "codex")
    done = _run(argv + ["Say hello in one short sentence."], env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    events = _events(done.stdout)
    answers = [e["item"]["text"] for e in events if e.get("type") == "item.completed"
               and e["item"].get("type") == "agent_message"]
    assert answers and answers[-1].strip(), done.stdout[-3000:]
    assert events[-1]["type"] == "turn.completed"


def test_codex_exec_tool_round_trip(served, tmp_path):
    argv, env = _codex(served, tmp_path / "codex")
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text(MARKER + "\n")
    before = requests(served, "/v1/responses")
    prompt = 'Call the exec_command tool with {"cmd": "ls"} and then tell me the file names it printed.'
    for _ in range(2):  # the model may answer without calling the tool: once more
        done = _run(argv + ["-C", str(work), prompt], env, work)
        assert done.returncode == 0, done.stderr[-3000:]
        events = _events(done.stdout)
        ran = [e["item"] for e in events if e.get("type") == "item.completed"
               and e["item"].get("type") == "command_execution"]
        if ran:
            break
    assert ran, f"the model called no tool: {done.stdout[-3000:]}"
    assert "notes.txt" in ran[0]["aggregated_output"]
    # after the call, Codex sent its output back and the turn ended on the answer to that request
    assert events[-1]["type"] == "turn.completed", done.stdout[-3000:]
    i = next(k for k, e in enumerate(events) if e.get("type") == "item.completed" and e["item"] == ran[0])
    assert any(e.get("type") == "item.completed" and e["item"].get("type") == "agent_message" for e in events[i:])
    after = requests(served, "/v1/responses")
    assert after.get("200", 0) - before.get("200", 0) >= 2 and set(after) == {"200"}, after


# --- Claude Code --------------------------------------------------------------------------------

def _claude(url: str, home: Path) -> tuple[list[str], dict]:
    if shutil.which("claude") is None:
        pytest.skip("claude is not on PATH (make install-agents)")
    home.mkdir(exist_ok=True)
    env = dict(os.environ, **QUIET, HOME=str(home), ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="unused",
               ANTHROPIC_MODEL="qwen2.5-coder-1.5b-instruct", ANTHROPIC_SMALL_FAST_MODEL="qwen2.5-coder-1.5b-instruct",
               CLAUDE_CODE_MAX_CONTEXT_TOKENS="32768", API_TIMEOUT_MS="900000", CLAUDE_STREAM_IDLE_TIMEOUT_MS="900000")
    env.pop("ANTHROPIC_AUTH_TOKEN", None)
    return ["claude", "-p", "--no-session-persistence"], env


def test_claude_print_answers(served, tmp_path):
    argv, env = _claude(served, tmp_path / "home")
    done = _run(argv + ["Say hello in one short sentence."], env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), done.stderr[-3000:]


def test_claude_print_tool_round_trip(served, tmp_path):
    argv, env = _claude(served, tmp_path / "home")
    work = tmp_path / "work"
    work.mkdir()
    notes = work / "notes.txt"
    notes.write_text(MARKER + "\n")
    before = requests(served, "/v1/messages")
    prompt = f"Use the Read tool to read the file {notes}, then tell me what it says."
    for _ in range(2):  # the model may answer without calling the tool: once more
        done = _run(argv + ["--tools", "Read", "--output-format", "stream-json", "--verbose", prompt], env, work)
        assert done.returncode == 0, done.stderr[-3000:]
        messages = _events(done.stdout)
        results = [block for m in messages if m.get("type") == "user" for block in m["message"]["content"]
                   if isinstance(block, dict) and block.get("type") == "tool_result"]
        if results:
            break
    assert results, f"the model called no tool: {done.stdout[-3000:]}"
    assert MARKER in json.dumps(results[0]["content"])  # the CLI ran Read and sent its result back
    final = messages[-1]
    assert final["type"] == "result" and final["subtype"] == "success" and not final["is_error"], final
    assert final["num_turns"] >= 2 and final["result"].strip()
    after = requests(served, "/v1/messages")
    assert after.get("200", 0) - before.get("200", 0) >= 2 and set(after) == {"200"}, after
