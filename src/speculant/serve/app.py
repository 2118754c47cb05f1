"""The FastAPI application: OpenAI's chat and text completions over one SpeculativeDecoder, and
llama-server's ``/infill`` (``infill``) for editors.

``create_app(decoder, ServeConfig(...))`` builds it. Requests are checked (``schema``), queued
(``scheduler``) and answered as OpenAI answers: a JSON body, or with ``"stream": true`` server-sent
events in OpenAI's chunk format ending with ``data: [DONE]``. A completions request with several
prompts runs them as generations of the batch, ``n`` choices each (``inputs``); one with a
``suffix`` has its prompt built from the model's fill-in-the-middle tokens (``fim``). With
logprobs asked for, every token's log-probabilities are in the body's ``logprobs``, or in the
chunk sent for that token (``logprobs`` module). Chat messages are rendered here through the model's
chat template, with the request's tools and extra template variables (``chat_template_kwargs``,
``reasoning_effort``: ``reasoning`` module). With ``tools``, the calls the model writes come back
as ``message.tool_calls`` (streamed: ``delta.tool_calls``) with ``finish_reason`` "tool_calls"
(``tools`` module), or, for the deprecated ``functions``, as ``message.function_call``
(``functions`` module). A thinking model's thinking comes back apart from its answer, as
``reasoning_content``. Every error has OpenAI's shape,
including a fault after a stream has begun (an error event, then the stream ends). A client that
goes away has its generation cancelled within one decoding step. If the scheduler's worker stops
for good, ``/health`` answers 503 with the reason, new requests get 503, and
``app.state.shutdown(reason)`` (set by ``server.serve``) is called to end the process. A request's
prompt starts from the decoder's prefix cache unless it sends ``"cache_prompt": false``; its usage
says how many prompt tokens came from there (``prompt_tokens_details.cached_tokens``), and
``/metrics`` has the cache's figures (``metrics.MemoryCollector``). ``GET /``
is a chat page (``static/``: plain HTML, CSS and JavaScript, no build step) that streams answers
with each token coloured by its source (the extension ``speculative.sources``). Anthropic's
Messages (``anthropic``) and OpenAI's Responses (``openai_responses``) are adapters that run a chat
request through ``complete`` (``conversation``); ``/tokenize`` and ``/detokenize`` are ``tokenize``'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import ConfigError
from ..store.chat import chat_messages_prompt
from .errors import APIError, bad_request
from .fim import fim_prompt, fim_tokens
from .infill import infill_reply, parse_infill
from .inputs import check_vocabulary
from .logprobs import Logprobs, token_strings
from .responses import ClientGone, Response as Reply, error_of, merged, next_event, stream, stopped
from .anthropic import add_messages_routes
from .conversation import ChatPath, Observer
from .metrics import Metrics
from .openai_responses import add_responses_routes
from .tokenize import add_tokenizer_routes
from .reasoning import Thinking
from .scheduler import Failed, Finished, Job, QueueFull, Scheduler, Started, Ticket, WorkerStopped
from .schema import MAX_DEPTH, CompletionRequest, parse_request, show
from .tools import bare_call_names, call_grammar, tool_format

log = logging.getLogger("speculant.serve")
STATIC = Path(__file__).parent / "static"  # the chat page served at /


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


def create_app(decoder, config: ServeConfig = ServeConfig()) -> FastAPI:
    """The application serving ``decoder`` (a SpeculativeDecoder); its scheduler starts with it."""
    model_id = config.model_id or decoder.target.name
    metrics = Metrics(decoder.method, decoder)
    string = token_strings(decoder.tokenizer)  # a token id's string, for logprobs
    calls_format = tool_format(decoder.tokenizer)  # how the chat template has the model write tool calls
    fim = fim_tokens(decoder.tokenizer, decoder.vocab_size)  # the model's fill-in-the-middle tokens, or None
    thinking = Thinking.of(decoder.tokenizer)  # the chat template's thinking switch and tags

    def chat_prompt(req: CompletionRequest) -> tuple[list[int], str]:
        """A chat's token ids and text: its messages in the model's chat template, with its tools
        and its extra template variables; a 400 if the template cannot render them."""
        uses = [i for i, m in enumerate(req.prompt) if m["role"] == "tool" or "tool_calls" in m]
        if req.tools is not None or uses:
            param = "tools" if req.tools is not None else f"messages[{uses[0]}]"
            if calls_format is None:
                raise bad_request(f"{param}: the model's chat template has no tool support (it does not render "
                                  "tools or tool calls); send a conversation without them", param=param,
                                  code="unsupported_parameter")
            if calls_format == "unknown" and req.tools is not None:
                raise bad_request("tools: the model's chat template writes tool calls in a format this server "
                                  "cannot parse yet (it knows Hermes' <tool_call> tags)", param="tools",
                                  code="unsupported_parameter")
        try:
            text = chat_messages_prompt(decoder.tokenizer, req.prompt, req.tools, req.template_variables)
        except ConfigError as e:
            raise bad_request(str(e), param="messages") from None
        except Exception as e:  # noqa: BLE001 -- the template's own refusal, or it broke on this input
            what = " and tools" if req.tools is not None else ""
            raise bad_request(f"the model's chat template refused the messages{what}: {type(e).__name__}: {e}",
                              param="messages") from None
        return decoder.tokenizer(text, add_special_tokens=False).input_ids, text

    def job_prompts(req: CompletionRequest, infill: bool = False) -> list:
        """Every prompt of a completions request as a Job takes it: its text or token ids, or with
        a suffix (fill in the middle; ``infill``: /infill's) the token ids built from the model's
        FIM tokens."""
        if req.suffix is None:
            return [p if isinstance(p, str) else list(p) for p in req.prompts]
        if fim is None:
            what = "/infill needs" if infill else "'suffix' needs"
            raise bad_request(f"{what} fill-in-the-middle tokens and this model has none (its vocabulary has none "
                              "of <|fim_prefix|>, <fim_prefix>, <PRE> and their kin), so it cannot fill the text "
                              "between a prefix and a suffix; send a plain prompt to /v1/completions to continue "
                              "it instead", param=None if infill else "suffix", code="unsupported_parameter")
        return [fim_prompt(decoder.tokenizer, fim, p, req.suffix, req.middle, req.repository) for p in req.prompts]

    def echoed(prompt) -> str:
        """A prompt's text as echo gives it back (token ids decoded)."""
        return prompt if isinstance(prompt, str) else decoder.tokenizer.decode(list(prompt))

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
        if app.state.shutdown is not None:
            app.state.shutdown(reason)

    scheduler = Scheduler(decoder, config.max_queue, on_finish=finished, max_batch=config.max_batch, on_fatal=fatal)

    def problem() -> str | None:
        """Why the decoding worker stopped for good, or None while it runs."""
        return scheduler.problem

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.get_running_loop().run_in_executor(None, scheduler.close)

    app = FastAPI(title="speculant", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.model_id = scheduler, metrics, model_id
    app.state.shutdown = None  # how the process ends when the worker stops for good: server.serve sets it

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        what = "no such endpoint" if e.status_code == 404 else str(e.detail)
        return APIError(e.status_code, f"{what}: {request.method} {request.url.path} (see GET /v1/models, "
                                       "POST /v1/chat/completions, POST /v1/completions, POST /infill, "
                                       "POST /v1/messages, POST /v1/responses)",
                        code="not_found" if e.status_code == 404 else None).response()

    def authorize(request: Request) -> None:
        """The key as ``Authorization: Bearer <key>`` or (Anthropic's clients) ``x-api-key: <key>``."""
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>' "
                                "(or 'x-api-key: <key>') with the key the server was started with",
                           type="authentication_error", code="invalid_api_key")

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
            raise bad_request(f"the request body is not valid JSON: {e.msg} at line {e.lineno} "
                              f"column {e.colno}") from None
        except RecursionError:
            raise bad_request(f"the request body is nested too deeply to read (at most {MAX_DEPTH} levels): "
                              "send a flatter body") from None
        except ValueError as e:  # NaN / Infinity, or an integer of thousands of digits
            raise bad_request(f"the request body is not valid JSON: {e}") from None

    async def complete(request: Request, kind: str, body: Any = None, observer: Observer | None = None) -> Response:
        """One request of ``kind``; ``body`` and ``observer``: a chat request an adapter built
        (``conversation``: Anthropic's Messages, OpenAI's Responses), with any model name, whose
        prompt size and finished generations the observer is given."""
        endpoint, arrived = request.url.path, time.perf_counter()
        tickets: list[Ticket] = []
        try:
            authorize(request)
            if body is None:
                body = await read_json(request)
            req, infill_options = parse_infill(body) if kind == "infill" else (parse_request(body, kind), None)
            if observer is None and req.model not in (model_id, "default"):
                raise APIError(404, f"the model {show(req.model)} is not served here; use {model_id!r} "
                                    "(GET /v1/models lists it)", param="model", code="model_not_found")
            context = decoder.max_length
            capped = observer is not None and observer.cap_tokens  # max_tokens a cap: cut to the room left
            if not capped and req.max_tokens is not None and context is not None and req.max_tokens >= context:
                raise bad_request(f"max_tokens is {req.max_tokens} but the model's context is {context} tokens "
                                  "(prompt included): ask for fewer", param="max_tokens")
            outside = [t for t, _ in req.logit_bias if t >= decoder.vocab_size]
            if outside:
                raise bad_request(f"'logit_bias' names token id {outside[0]}, outside the model's vocabulary (ids 0 "
                                  f"to {decoder.vocab_size - 1})", param="logit_bias")
            check_vocabulary(req.prompts, decoder.vocab_size)
            if len(req.prompts) > 1 and len(req.prompts) * req.n > config.max_queue:
                raise bad_request(f"the request asks for {len(req.prompts) * req.n} generations ({len(req.prompts)} "
                                  f"prompts, n {req.n}) but the server queues at most {config.max_queue} "
                                  "(--max-queue): send fewer prompts", param="prompt")
            opened = None  # a thinking template: whether the completion starts inside the thinking
            if kind == "chat":
                thinking.check(req.template_variables, req.reasoning_effort)
                ids, text = await asyncio.get_running_loop().run_in_executor(None, chat_prompt, req)
                if capped and context is not None and req.max_tokens is not None and len(ids) < context:
                    req = dataclasses.replace(req, max_tokens=min(req.max_tokens, context - len(ids)))
                prompts, opened = [ids], (thinking.opened(text) if thinking.tags else None)
            else:
                prompts = await asyncio.get_running_loop().run_in_executor(None, job_prompts, req,
                                                                           infill_options is not None)
            base = Job(prompts[0], req.max_tokens, req.temperature, req.top_p, req.top_k,
                       req.seed, req.stop,
                       min_p=req.min_p, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                       repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias, logprobs=req.logprobs,
                       response_format=forced_format(req), max_draft_depth=req.max_draft_depth,
                       prompt_logprobs=req.logprobs if req.echo else None, prediction=req.prediction,
                       end_tokens=tuple(sorted(fim.ends)) if req.suffix is not None else (),
                       cache_prompt=req.cache_prompt)
            try:
                for prompt in prompts:  # n choices a prompt: n generations of the batch, seeds seed, seed + 1, ...
                    for i in range(req.n):
                        job = dataclasses.replace(base, prompt=prompt, seed=choice_seed(req.seed, i))
                        tickets.append(scheduler.submit(job, asyncio.get_running_loop()))
            except QueueFull:
                for ticket in tickets:
                    ticket.cancel()
                raise APIError(429, f"the server is busy: {config.max_queue} requests are already waiting; "
                                    f"retry in {config.retry_after} s", type="rate_limit_error",
                               code="queue_full", headers={"Retry-After": str(config.retry_after)}) from None
            except WorkerStopped as e:
                for ticket in tickets:
                    ticket.cancel()
                raise stopped(str(e)) from None
            metrics.set_queue(scheduler.waiting, scheduler.running)
            starts = []
            for ticket in tickets:
                first = await next_event(ticket, problem, request.is_disconnected)
                if isinstance(first, Failed):
                    for other in tickets:
                        other.cancel()
                    raise error_of(first)
                starts.append(first)
        except APIError as e:
            metrics.request(endpoint, e.status)
            return e.response()
        except (ClientGone, ClientDisconnect):
            for ticket in tickets:
                ticket.cancel()
            metrics.request(endpoint, 499)
            return Response(status_code=499)
        except Exception as e:  # a fault of this request's own: a 500 in OpenAI's shape
            log.exception("request failed")
            for ticket in tickets:
                ticket.cancel()
            metrics.request(endpoint, 500)
            return APIError(500, f"the request failed: {type(e).__name__}: {e}", type="server_error").response()
        if infill_options is not None:
            try:
                return await infill_reply(tickets[0], req, infill_options, model=model_id, method=decoder.method,
                                          tokenizer=decoder.tokenizer, problem=problem, gone=request.is_disconnected,
                                          done=lambda status: metrics.request(endpoint, status))
            except ClientGone:
                tickets[0].cancel()
                metrics.request(endpoint, 499)
                return Response(status_code=499)
            except Exception as e:
                log.exception("request failed")
                tickets[0].cancel()
                metrics.request(endpoint, 500)
                return APIError(500, f"the request failed: {type(e).__name__}: {e}", type="server_error").response()
        reply = Reply(kind, model_id, decoder.method, arrived, metrics, len(tickets),
                      None if req.logprobs is None else (lambda: Logprobs(kind, string)),
                      calls_format if req.tools is not None else None,
                      echo=[echoed(p) for p in req.prompts for _ in range(req.n)] if req.echo else None,
                      bare=bare_call_names(req.tools, req.tool_choice), per_prompt=req.n,
                      prediction=req.prediction is not None, functions=req.functions, reasoning=opened)
        for index, first in enumerate(starts):
            reply.started(index, first)
        if observer is not None:
            observer.prompt_tokens = reply.prompt_tokens(tickets)
        if req.stream:
            metrics.request(endpoint, 200)
            return StreamingResponse(stream(tickets, req.include_usage, reply, problem,
                                            req.token_sources, observer),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            events: dict[int, Finished] = {}
            async with aclosing(merged(tickets, problem, request.is_disconnected)) as source:
                async for index, event in source:
                    if isinstance(event, Failed):
                        for other in tickets:
                            other.cancel()
                        metrics.request(endpoint, event.status)
                        return error_of(event).response()
                    if isinstance(event, Finished):
                        events[index] = event
                    elif not isinstance(event, Started):
                        reply.token(index, event)
            answer = JSONResponse(reply.body([events[i] for i in range(len(tickets))], reply.prompt_tokens(tickets)))
            if observer is not None:
                observer.finished = [events[i] for i in range(len(tickets))]
        except ClientGone:
            for ticket in tickets:
                ticket.cancel()
            metrics.request(endpoint, 499)
            return Response(status_code=499)
        except Exception as e:
            log.exception("request failed")
            for ticket in tickets:
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

    @app.post("/infill")
    async def infill(request: Request):
        """llama-server's code infill (``infill``): what editor plugins call for autocomplete."""
        return await complete(request, "infill")

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        metrics.request("/v1/models", 200)
        entry = {"id": model_id, "object": "model", "created": 0, "owned_by": "speculant"}
        if decoder.max_length is not None:  # the context, under the names OpenAI-compatible servers use
            entry.update(context_length=decoder.max_length, max_model_len=decoder.max_length,
                         meta={"n_ctx_train": decoder.max_length, "n_vocab": decoder.vocab_size})
        return {"object": "list", "data": [entry]}

    add_tokenizer_routes(app, decoder.tokenizer, decoder.vocab_size, authorize, read_json)
    chat = ChatPath(model_id, complete, authorize, read_json, chat_prompt, thinking, decoder.tokenizer)
    add_messages_routes(app, chat)
    add_responses_routes(app, chat)

    @app.get("/health")
    async def health():
        state = {"model": model_id, "method": decoder.method, "waiting": scheduler.waiting,
                 "running": scheduler.running}
        problem = scheduler.problem
        if problem is not None:  # ASCII JSON, as errors are: the reason may quote anything
            return Response(json.dumps({"status": "failed", "error": stopped(problem).message, **state}),
                            status_code=503, media_type="application/json")
        return {"status": "ok", **state}

    @app.get("/", include_in_schema=False)
    async def chat_page():
        """The chat page (static/index.html): no build step, no state on the server."""
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/metrics")
    async def prometheus():
        metrics.set_queue(scheduler.waiting, scheduler.running)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number: send a finite number")


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index``: ``seed + index``, wrapped into the 64-bit signed range."""
    if seed is None:
        return None
    return (seed + index + 2**63) % 2**64 - 2**63
