"""Run the application with uvicorn: load once, warm up, print the URL, serve until SIGINT/SIGTERM.

On SIGTERM uvicorn stops accepting connections and lets the requests in flight finish (at most
``drain_timeout`` seconds), then the scheduler finishes its queue and the process exits.
"""

from __future__ import annotations

import sys

import uvicorn

from .app import ServeConfig, create_app


def warm_up(decoder) -> None:
    """One short generation: the kernels, caches and the drafter's first use are paid here."""
    prompt = ([{"role": "user", "content": "Hello"}] if getattr(decoder.tokenizer, "chat_template", None)
              else "Hello")
    decoder.generate(prompt, 4)


def serve(decoder, config: ServeConfig, drain_timeout: int = 60) -> None:
    app = create_app(decoder, config)
    warm_up(decoder)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           timeout_graceful_shutdown=drain_timeout, access_log=False))
    url = f"http://{config.host}:{config.port}/v1"
    key = " (API key required: Authorization: Bearer ...)" if config.api_key else ""
    print(f"speculant: serving {app.state.model_id} ({decoder.method}) at {url}{key}; Ctrl-C stops",
          file=sys.stderr, flush=True)
    server.run()
