"""A speculant server on a free loopback port, in a thread of the test process (for tests/test_serve*.py),
and the fixtures of the tests that serve the tiny model pair (``tiny.tiny_pair``): ``dirs``,
``reference`` (plain decoding), ``server`` (speculative decoding with the draft) and ``client``
(the ``openai`` client of that server). A test module uses them by importing them."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from speculant import SpeculativeDecoder
from speculant.serve.app import ServeConfig, create_app

from tiny import tiny_pair

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
