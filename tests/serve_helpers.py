"""A speculant server on a free loopback port, in a thread of the test process (for tests/test_serve*.py)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from speculant.serve.app import ServeConfig, create_app

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
