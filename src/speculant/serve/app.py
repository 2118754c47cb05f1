"""The FastAPI application: OpenAI's chat and text completions over one SpeculativeDecoder.

``create_app(decoder, ServeConfig(...))`` builds it. Requests are checked (``schema``), queued
(``scheduler``) and answered as OpenAI answers: a JSON body, or with ``"stream": true`` server-sent
events in OpenAI's chunk format ending with ``data: [DONE]``; with logprobs asked for, every
token's log-probabilities are in the body's ``logprobs``, or in the chunk sent for that token
(``logprobs`` module). With ``tools``, the messages are rendered here with the tools through the
model's chat template, and the calls the model writes come back as ``message.tool_calls`` (streamed:
``delta.tool_calls``) with ``finish_reason`` "tool_calls" (``tools`` module). Every error has OpenAI's shape,
including a fault after a stream has begun (an error event, then the stream ends). A client that
goes away has its generation cancelled within one decoding step. If the scheduler's worker stops
for good, ``/health`` answers 503 with the reason, new requests get 503, and
``app.state.shutdown(reason)`` (set by ``server.serve``) is called to end the process.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import ConfigError
from ..store.models import chat_messages_prompt
from .errors import APIError, bad_request
from .logprobs import Logprobs, token_strings
from .metrics import Metrics
from .scheduler import Failed, Finished, Job, QueueFull, Scheduler, Started, Ticket, Token, WorkerStopped
from .schema import MAX_DEPTH, CompletionRequest, parse_request, show
from .tools import ToolStream, call_grammar, join, tool_format

log = logging.getLogger("speculant.serve")
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


@dataclass(frozen=True)
class ServeConfig:
    """How the server runs: ``api_key`` (None: no key needed), ``max_queue`` (requests waiting
    beyond the running ones; more get 429), ``max_batch`` (requests decoded together, one target
    pass per step for all of them: continuous batching), ``max_body_bytes`` (larger bodies get 413),
    ``model_id`` (None: the target's name; "default" is always accepted too), ``retry_after``
    (seconds, in a 429's Retry-After)."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 16
    max_batch: int = 4  # docs/design-notes.md#batching-without-padding
    max_body_bytes: int = 1 << 20
    model_id: str | None = None
    retry_after: int = 2


class _ClientGone(Exception):
    pass


def _error(event: Failed) -> APIError:
    return APIError(event.status, event.message, param=event.param,
                    type="invalid_request_error" if event.status < 500 else "server_error",
                    code="worker_stopped" if event.status == 503 else None)


def _stopped(reason: str) -> APIError:
    return APIError(503, f"the server's decoding worker stopped ({reason}); the server is shutting down: "
                         "retry when it is back", type="server_error", code="worker_stopped")


def create_app(decoder, config: ServeConfig = ServeConfig()) -> FastAPI:
    """The application serving ``decoder`` (a SpeculativeDecoder); its scheduler starts with it."""
    model_id = config.model_id or decoder.target.name
    metrics = Metrics(decoder.method)
    string = token_strings(decoder.tokenizer)  # a token id's string, for logprobs
    calls_format = tool_format(decoder.tokenizer)  # how the chat template has the model write tool calls

    def tool_prompt(req: CompletionRequest) -> list[int] | None:
        """The token ids of a chat with tools or tool messages, rendered here (the decoder renders
        plain chats itself); None for one without; a 400 if the chat template cannot render them."""
        uses = [i for i, m in enumerate(req.prompt) if m["role"] == "tool" or "tool_calls" in m]
        if req.tools is None and not uses:
            return None
        param = "tools" if req.tools is not None else f"messages[{uses[0]}]"
        if calls_format is None:
            raise bad_request(f"{param}: the model's chat template has no tool support (it does not render "
                              "tools or tool calls); send a conversation without them", param=param,
                              code="unsupported_parameter")
        if calls_format == "unknown" and req.tools is not None:
            raise bad_request("tools: the model's chat template writes tool calls in a format this server cannot "
                              "parse yet (it knows Hermes' <tool_call> tags)", param="tools",
                              code="unsupported_parameter")
        try:
            text = chat_messages_prompt(decoder.tokenizer, req.prompt, req.tools)
        except ConfigError as e:
            raise bad_request(str(e), param="messages") from None
        except Exception as e:  # noqa: BLE001 -- the template's own refusal, or it broke on this input
            raise bad_request(f"the model's chat template refused the messages and tools: {type(e).__name__}: "
                              f"{e}", param="messages") from None
        return decoder.tokenizer(text, add_special_tokens=False).input_ids

    def forced_format(req: CompletionRequest) -> dict | None:
        """The request's response_format, or with tool_choice "required" or a named function the
        grammar of the calls it allows (the template's format was checked by ``tool_prompt``)."""
        if req.tool_choice not in ("required", "function"):
            return req.response_format
        return {"type": "grammar", "grammar": call_grammar(req.tools, decoder.tokenizer, req.tool_name,
                                                           req.parallel_tool_calls)}

    def finished(ticket: Ticket, event) -> None:
        metrics.set_queue(scheduler.waiting, scheduler.running)
        if isinstance(event, Finished):
            metrics.generation(ticket.prompt_tokens, len(event.token_ids), event.finish_reason, event.stats)

    def fatal(reason: str) -> None:
        shutdown = getattr(app.state, "shutdown", None)
        if shutdown is not None:
            shutdown(reason)

    scheduler = Scheduler(decoder, config.max_queue, on_finish=finished, max_batch=config.max_batch, on_fatal=fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.get_running_loop().run_in_executor(None, scheduler.close)

    app = FastAPI(title="speculant", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.model_id = scheduler, metrics, model_id

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        what = "no such endpoint" if e.status_code == 404 else str(e.detail)
        return APIError(e.status_code, f"{what}: {request.method} {request.url.path} (see GET /v1/models, "
                                       "POST /v1/chat/completions, POST /v1/completions)",
                        code="not_found" if e.status_code == 404 else None).response()

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>' "
                                "with the key the server was started with", type="authentication_error",
                           code="invalid_api_key")

    async def read_json(request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            raise APIError(413, f"the request body is {int(length)} bytes; the limit is {config.max_body_bytes}",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise APIError(413, f"the request body is over the limit of {config.max_body_bytes} bytes",
                               code="request_too_large")
            chunks.append(chunk)
        try:
            text = b"".join(chunks).decode("utf-8")
        except UnicodeDecodeError as e:
            raise bad_request(f"the request body is not valid UTF-8 (byte {e.start}): send UTF-8 JSON") from None
        try:
            return json.loads(text, parse_constant=_no_constant)
        except json.JSONDecodeError as e:
            raise bad_request(f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        except RecursionError:
            raise bad_request(f"the request body is nested too deeply to read (at most {MAX_DEPTH} levels): "
                              "send a flatter body") from None
        except ValueError as e:  # NaN / Infinity, or an integer of thousands of digits
            raise bad_request(f"the request body is not valid JSON: {e}") from None

    async def next_event(ticket: Ticket, request: Request):
        """The ticket's next event; cancels the job if the client goes away while waiting."""
        while True:
            try:
                return await asyncio.wait_for(ticket.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if scheduler.problem is not None and ticket.events.empty():
                    return Failed(503, _stopped(scheduler.problem).message)
                if await request.is_disconnected():
                    ticket.cancel()
                    raise _ClientGone from None

    async def complete(request: Request, kind: str) -> Response:
        endpoint, arrived = request.url.path, time.perf_counter()
        try:
            authorize(request)
            req = parse_request(await read_json(request), kind)
            if req.model not in (model_id, "default"):
                raise APIError(404, f"the model {show(req.model)} is not served here; use {model_id!r} "
                                    "(GET /v1/models lists it)", param="model", code="model_not_found")
            context = decoder.max_length
            if req.max_tokens is not None and context is not None and req.max_tokens >= context:
                raise bad_request(f"max_tokens is {req.max_tokens} but the model's context is {context} tokens "
                                  "(prompt included): ask for fewer", param="max_tokens")
            outside = [t for t, _ in req.logit_bias if t >= decoder.vocab_size]
            if outside:
                raise bad_request(f"'logit_bias' names token id {outside[0]}, outside the model's vocabulary (ids 0 "
                                  f"to {decoder.vocab_size - 1})", param="logit_bias")
            ids = None
            if kind == "chat" and (req.tools is not None or any("tool_calls" in m or m["role"] == "tool"
                                                                 for m in req.prompt)):
                ids = await asyncio.get_running_loop().run_in_executor(None, tool_prompt, req)
            job = Job(req.prompt if ids is None else ids, req.max_tokens, req.temperature, req.top_p, req.top_k,
                      req.seed, req.stop,
                      min_p=req.min_p, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                      repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias, logprobs=req.logprobs,
                      response_format=forced_format(req))
            try:
                ticket = scheduler.submit(job, asyncio.get_running_loop())
            except QueueFull:
                raise APIError(429, f"the server is busy: {config.max_queue} requests are already waiting; "
                                    f"retry in {config.retry_after} s", type="rate_limit_error",
                               code="queue_full", headers={"Retry-After": str(config.retry_after)}) from None
            except WorkerStopped as e:
                raise _stopped(str(e)) from None
            metrics.set_queue(scheduler.waiting, scheduler.running)
            first = await next_event(ticket, request)
            if isinstance(first, Failed):
                raise _error(first)
        except APIError as e:
            metrics.request(endpoint, e.status)
            return e.response()
        except (_ClientGone, ClientDisconnect):
            metrics.request(endpoint, 499)
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 -- a fault of this request's own: a 500 in OpenAI's shape
            log.exception("request failed")
            metrics.request(endpoint, 500)
            return APIError(500, f"the request failed: {type(e).__name__}: {e}", type="server_error").response()
        meta = _Meta(kind, model_id, decoder.method, arrived, metrics,
                     None if req.logprobs is None else Logprobs(kind, string),
                     calls_format if req.tools is not None else None)
        if req.stream:
            metrics.request(endpoint, 200)
            return StreamingResponse(_sse(ticket, req, meta, scheduler), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            while not isinstance(event := await next_event(ticket, request), (Finished, Failed)):
                meta.token(event)
            if isinstance(event, Failed):
                metrics.request(endpoint, event.status)
                return _error(event).response()
            answer = JSONResponse(meta.body(event, ticket.prompt_tokens))
        except _ClientGone:
            metrics.request(endpoint, 499)
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001
            log.exception("request failed")
            ticket.cancel()
            metrics.request(endpoint, 500)
            return APIError(500, f"the request failed: {type(e).__name__}: {e}", type="server_error").response()
        metrics.request(endpoint, 200)
        return answer

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, "completion")

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        metrics.request("/v1/models", 200)
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "speculant"}]}

    @app.get("/health")
    async def health():
        state = {"model": model_id, "method": decoder.method, "waiting": scheduler.waiting,
                 "running": scheduler.running}
        problem = scheduler.problem
        if problem is not None:  # ASCII JSON, as errors are: the reason may quote anything
            return Response(json.dumps({"status": "failed", "error": _stopped(problem).message, **state}),
                            status_code=503, media_type="application/json")
        return {"status": "ok", **state}

    @app.get("/metrics")
    async def prometheus():
        metrics.set_queue(scheduler.waiting, scheduler.running)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


class _Meta:
    """One response's identity and the pieces of its body; ``logprobs`` (None: not asked for)
    collects its tokens' logprobs."""

    def __init__(self, kind: str, model: str, method: str, arrived: float, metrics: Metrics,
                 logprobs: Logprobs | None = None, tools: str | None = None):
        self.kind, self.model, self.method, self.arrived, self.metrics = kind, model, method, arrived, metrics
        self.tools = None if tools is None else ToolStream(tools)  # parses tool calls out of the text
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.first = True
        self.logprobs = logprobs

    def token(self, event: Token) -> dict | None:
        """Take a token's event; returns its logprobs object (None: not asked for)."""
        if self.first:
            self.metrics.first_token(time.perf_counter() - self.arrived)
            self.first = False
        return None if self.logprobs is None else self.logprobs.add(event)

    def usage(self, event: Finished, prompt_tokens: int) -> dict[str, Any]:
        s = event.stats
        n = len(event.token_ids)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
                "speculative": {"method": self.method, "target_calls": s.target_calls if s else 0,
                                "tokens_per_call": s.tokens_per_call if s else 0.0,
                                "acceptance_rate": s.acceptance_rate if s else 0.0}}

    def body(self, event: Finished, prompt_tokens: int) -> dict[str, Any]:
        reason = _FINISH[event.finish_reason]
        logprobs = None if self.logprobs is None else self.logprobs.all
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": event.text}
            if self.tools is not None:
                message["content"], calls = join(self.tools.feed(event.text) + self.tools.finish())
                if calls:
                    message["tool_calls"] = calls
                    reason = _calls_finish(reason)
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": event.text, "logprobs": logprobs, "finish_reason": reason}
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.usage(event, prompt_tokens)}

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False,
              usage: dict | None = None, logprobs: dict | None = None, delta: dict | None = None) -> str:
        if usage is not None:
            choices: list = []
        elif self.kind == "chat":
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choices = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
        else:
            choices = [{"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]
        body = {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"


def _calls_finish(reason: str) -> str:
    """The finish reason of a response with tool calls: "tool_calls", unless it was cut short."""
    return reason if reason == "length" else "tool_calls"


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number: send a finite number")


async def _sse(ticket: Ticket, req: CompletionRequest, meta: _Meta, scheduler: Scheduler) -> AsyncIterator[str]:
    """The stream of one request; cancelling it (the client went away) cancels its generation. A
    fault after the stream has begun is sent as OpenAI does, ``data: {"error": {...}}``, and ends it."""
    try:
        if meta.kind == "chat":
            yield meta.chunk(role=True)
        while True:
            try:
                event = await asyncio.wait_for(ticket.events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if scheduler.problem is None or not ticket.events.empty():
                    continue
                event = Failed(503, _stopped(scheduler.problem).message)
            if isinstance(event, Token):
                logprobs = meta.token(event)
                if meta.tools is not None:
                    deltas = meta.tools.feed(event.text) or ([{}] if logprobs is not None else [])
                    for i, delta in enumerate(deltas):  # the token's logprobs ride with its first chunk
                        yield meta.chunk(delta=delta, logprobs=logprobs if i == 0 else None)
                elif event.text or logprobs is not None:  # with logprobs, every token has its chunk
                    yield meta.chunk(event.text, logprobs=logprobs)
            elif isinstance(event, Finished):
                finish = _FINISH[event.finish_reason]
                if meta.tools is not None:
                    for delta in meta.tools.finish():
                        yield meta.chunk(delta=delta)
                    finish = _calls_finish(finish) if meta.tools.calls else finish
                yield meta.chunk(None, finish=finish)
                if req.include_usage:
                    yield meta.chunk(usage=meta.usage(event, ticket.prompt_tokens))
                break
            elif isinstance(event, Failed):
                yield f"data: {json.dumps(_error(event).body())}\n\n"
                break
            elif isinstance(event, Started):
                continue
    except Exception as e:  # noqa: BLE001 -- the headers are sent: the fault goes in the stream
        log.exception("stream failed")
        error = APIError(500, f"the request failed: {type(e).__name__}: {e}", type="server_error")
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        ticket.cancel()  # a no-op when it finished; else it stops within one decoding step
    yield "data: [DONE]\n\n"
