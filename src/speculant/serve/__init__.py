"""``speculant serve``: an OpenAI-compatible HTTP server over one SpeculativeDecoder.

- ``schema``: request bodies checked field by field into ``CompletionRequest`` values;
- ``errors``: OpenAI's error shape;
- ``scheduler``: the bounded queue and the worker that runs generations;
- ``metrics``: the Prometheus metrics;
- ``app``: the FastAPI application (``create_app``);
- ``server``: uvicorn around it (``serve``).
"""

from .app import ServeConfig, create_app  # noqa: F401 -- the package's API
