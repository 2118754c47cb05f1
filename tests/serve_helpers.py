"""A speculant server on a free loopback port, in a thread of the test process (for tests/test_serve*.py),
and the fixtures of the tests that serve the tiny model pair (``tiny.tiny_pair``): ``dirs``,
``reference`` (plain decoding), ``server`` (speculative decoding with the draft) and ``client``
(the ``openai`` client of that server). A test module uses them by importing them.

The tool-calling tests serve the real Qwen2.5 tokenizer and chat template (``qwen_preset``): with a
scripted scheduler that answers every request with a given completion and records the jobs
(``scripted_server``: tiny random models write no tool calls), or with a tiny random Qwen2 behind
the real tokenizer (``tiny_qwen_server``: every call it writes under a grammar is the grammar's doing)."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn

from speculant import SpeculativeDecoder
from speculant.serve import app as app_module
from speculant.serve.app import ServeConfig, create_app
from speculant.serve.scheduler import Finished, Started, Ticket, Token

from tiny import tiny_pair, tiny_qwen2

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def wait_healthy(proc, url: str, timeout: float = 120.0) -> None:
    """Wait until the server process ``proc`` at ``url`` answers /health with 200 (it must not exit
    meanwhile, and must come up within ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """``create_app(decoder, config)`` served by uvicorn in a daemon thread; ``stop()`` shuts it down."""

    def __init__(self, decoder, **config):
        self.config = ServeConfig(port=free_port(), **config)
        self.app = create_app(decoder, self.config)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.config.port,
                                                    log_level="warning", timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    def post(self, path: str, body=None, *, content: bytes | None = None, headers=None, timeout: float = 60):
        return httpx.post(self.url + path, json=body if content is None else None, content=content,
                          headers=headers or {}, timeout=timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def tiny_decoder(dirs, method: str = "sd", **extra) -> SpeculativeDecoder:
    """A decoder of the tiny pair ``dirs`` running ``method`` (with the draft model for sd and
    mcsd), float32, pacing off, with the tests' chat template; ``extra``: more decoder options."""
    draft = dirs["draft"] if method in ("sd", "mcsd") else None
    dec = SpeculativeDecoder(dirs["target"], draft, method=method, dtype="float32", pacing=False, **extra)
    dec.tokenizer.chat_template = CHAT_TEMPLATE
    return dec


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def reference(dirs):
    """Plain greedy decoding, the expected output (never used by a server)."""
    return tiny_decoder(dirs, "ar")


@pytest.fixture(scope="module")
def server(dirs):
    """A server of the pair's speculative decoding (the draft model, gamma 3)."""
    s = RunningServer(tiny_decoder(dirs, "sd", gamma=3), max_queue=64)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def qwen_preset():
    """The directory of the Qwen2.5-Coder-1.5B-Instruct preset (its tokenizer and chat template);
    the test is skipped where it is not installed."""
    from speculant.store.models import resolve
    try:
        return resolve("qwen2.5-coder-1.5b-instruct")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the Qwen2.5 preset is not available here (make install): {e}")


@pytest.fixture(scope="module")
def qwen_dir():
    """The Qwen2.5 preset's directory (``qwen_preset``), once per test module."""
    return qwen_preset()


@pytest.fixture(scope="module")
def tokenizer(qwen_dir):
    """The Qwen2.5 preset's tokenizer, with its chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_dir))


class ScriptedScheduler:
    """A scheduler that answers every job with ``script["text"]`` (the tokenizer's tokens, one
    Token event each) and finish reason ``script.get("reason", "eos")``, and records the jobs."""

    def __init__(self, tokenizer, script: dict):
        self.tokenizer, self.script, self.jobs = tokenizer, script, []
        self.waiting = self.running = 0
        self.problem = None

    def submit(self, job, loop):
        self.jobs.append(job)
        ticket = Ticket(job, loop)
        ids = self.tokenizer(self.script["text"], add_special_tokens=False).input_ids
        ticket.prompt_tokens = len(job.prompt)
        ticket.send(Started(len(job.prompt)))
        before = ""
        for k in range(len(ids)):
            text = self.tokenizer.decode(ids[:k + 1])
            ticket.send(Token(ids[k], text[len(before):]))
            before = text
        ticket.send(Finished(ids, self.script["text"], self.script.get("reason", "eos"), None))
        return ticket

    def close(self):
        pass


def scripted_server(tokenizer) -> SimpleNamespace:
    """A server of ``tokenizer`` whose scheduler is a ScriptedScheduler: ``server``, ``client``
    (openai), ``script`` (set its "text" and "reason" before a request) and ``scheduler`` (its
    ``jobs``). Stop it with ``.server.stop()``."""
    script = {"text": ""}
    decoder = SimpleNamespace(tokenizer=tokenizer, target=SimpleNamespace(name="qwen"), method="ar",
                              max_length=32768, vocab_size=len(tokenizer), batch_pacer=None)
    real = app_module.Scheduler
    app_module.Scheduler = lambda dec, *a, **k: ScriptedScheduler(tokenizer, script)
    try:
        server = RunningServer(decoder)
    finally:
        app_module.Scheduler = real
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return SimpleNamespace(server=server, client=client, script=script, scheduler=server.app.state.scheduler)


def tiny_qwen_server(path, qwen_dir, tokenizer, cache) -> RunningServer:
    """A server of a tiny random Qwen2 (the real vocabulary, hidden size 64) saved at ``path`` with
    the preset's tokenizer and chat template, decoding by prompt lookup; what it caches goes to
    ``cache``."""
    model = tiny_qwen2(seed=0, vocab=151936, hidden=64, scale=4.0)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (qwen_dir / name).is_file():
            shutil.copy(qwen_dir / name, path / name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECULANT_CACHE", str(cache))
        return RunningServer(SpeculativeDecoder(str(path), method="lookup", dtype="float32", pacing=False))
