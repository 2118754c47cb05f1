"""Run the application with uvicorn: load once, warm up, print the URL, serve until SIGINT/SIGTERM.

On SIGTERM uvicorn stops accepting connections and lets the requests in flight finish (at most
``drain_timeout`` seconds), then the scheduler finishes its queue and the process exits. If the
scheduler's worker stops for good, the server shuts down the same way and ``serve`` exits with
status 1 (``WORKER_STOPPED``), so that a supervisor restarts it.
"""

from __future__ import annotations

import sys

import uvicorn

from .app import ServeConfig, create_app

WORKER_STOPPED = 1  # the exit status when the decoding worker stopped


def warm_up(decoder) -> None:
    """One short generation: the kernels, caches and the drafter's first use are paid here."""
    prompt = ([{"role": "user", "content": "Hello"}] if getattr(decoder.tokenizer, "chat_template", None)
              else "Hello")
    decoder.generate(prompt, 4)


def serve(decoder, config: ServeConfig, drain_timeout: int = 60) -> None:
    app = create_app(decoder, config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           timeout_graceful_shutdown=drain_timeout, access_log=False))

    def shutdown(reason: str) -> None:  # called in the worker thread; uvicorn checks the flag every 0.1 s
        server.should_exit = True

    app.state.shutdown = shutdown
    warm_up(decoder)
    url = f"http://{config.host}:{config.port}/v1"
    key = " (API key required: Authorization: Bearer ...)" if config.api_key else ""
    print(f"speculant: serving {app.state.model_id} ({decoder.method}) at {url}{key}; Ctrl-C stops",
          file=sys.stderr, flush=True)
    server.run()
    problem = app.state.scheduler.fatal
    if problem is not None:
        print(f"speculant: error: the decoding worker stopped ({problem}); the server shut down "
              f"(exit status {WORKER_STOPPED}) so that it can be restarted", file=sys.stderr, flush=True)
        raise SystemExit(WORKER_STOPPED)
