"""``POST /infill``: llama-server's code-infill endpoint, which editor plugins (llama.vscode,
llama.vim and others) call for autocomplete.

The request (llama-server's field names): ``input_prefix`` (the code before the cursor),
``input_suffix`` (after it), ``input_extra`` (``[{"filename", "text"}]``, other files as context),
``prompt`` (the start of the middle already written), and of ``/completion``'s options the ones
listed in ``HONOURED`` (``cache_prompt`` false: the prefix cache is neither read nor written).
The prompt is built from the model's own fill-in-the-middle tokens (``fim``). Sampling
defaults are llama-server's (temperature 0.8, top_k 40, top_p 0.95, min_p
0.05), so a client that sends none samples as it would there. ``ACCEPTED`` are hints to
llama-server's own scheduler, and its sampler order: accepted and not applied.
Any other field is refused with a 400 naming it.

The response is llama-server's: ``{"content", "tokens", "stop": true, "stop_type", "stopping_word",
"tokens_predicted", "tokens_evaluated", "timings": {...}, "truncated", ...}`` plus speculant's
``speculative`` figures; streamed, one ``data: {"content", "tokens", "stop": false}`` event per
token, then one with ``"stop": true`` and the rest (no ``[DONE]``, as llama-server). ``n_indent``
ends the middle before a line (after its first) indented less than that many spaces or tabs;
``t_max_predict_ms`` ends it once that long has passed since its first token and it has a newline;
``tokens_cached`` and ``timings.cache_n`` count the prompt tokens the prefix cache gave,
``timings.prompt_n`` those prefilled (as llama-server's); ``response_fields`` keeps only the
fields named (``"timings/prompt_n"`` reads into ``timings``, and the key is the path).
"""

from __future__ import annotations

import json
import math
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from fastapi.responses import JSONResponse, StreamingResponse

from .errors import APIError, bad_request, is_int, kind_of, show
from .responses import error_of, merged, speculative_usage
from .scheduler import Failed, Finished, Ticket, Token
from .schema import (MAX_INT32, SEED_RANGE, CompletionRequest, flag_field, number_field, speculative_field,
                     stop_field)

HONOURED = {"input_prefix", "input_suffix", "input_extra", "prompt", "model", "n_predict", "max_tokens",
            "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stream", "presence_penalty",
            "frequency_penalty", "repeat_penalty", "n_indent", "t_max_predict_ms", "return_tokens",
            "response_fields", "speculative", "cache_prompt"}
ACCEPTED = {"t_max_prompt_ms", "id_slot", "samplers", "timings_per_token"}
STOP_TYPE = {"eos": "eos", "stop": "word", "length": "limit", "cancelled": "limit"}


@dataclass(frozen=True)
class InfillOptions:
    """What shapes /infill's answer rather than the generation."""
    n_indent: int = 0  # 0: off
    t_max_predict_ms: float = 0.0  # 0: off
    return_tokens: bool = False
    response_fields: tuple[str, ...] | None = None  # None: every field


def parse_infill(body: Any) -> tuple[CompletionRequest, InfillOptions]:
    """An /infill body as a CompletionRequest (``suffix`` set: always fill in the middle) and the
    answer's options, or a 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {kind_of(body)}")
    unknown = sorted(set(body) - HONOURED - ACCEPTED)
    if unknown:
        raise bad_request(f"unknown field {show(unknown[0])}: /infill does not support it; remove it "
                          f"(it takes {', '.join(sorted(HONOURED))})", param=unknown[0], code="unsupported_parameter")
    texts = {name: _text(body, name) for name in ("input_prefix", "input_suffix", "prompt")}
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad_request(f"'model' must be a string, got {kind_of(body['model'])}", param="model")
    model = "default"  # the one model served, whatever the editor names (as llama-server serving one model)
    limit = body.get("n_predict", body.get("max_tokens"))
    name = "n_predict" if "n_predict" in body else "max_tokens"
    if limit is not None and (not is_int(limit) or not -1 <= limit <= MAX_INT32):
        raise bad_request(f"'{name}' must be an integer from -1 (up to the context) to {MAX_INT32}, got "
                          f"{show(limit)}", param=name)
    temperature = max(number_field(body, "temperature", 0.8, -math.inf, 2.0, "at most 2 (0 or less: greedy)"), 0.0)
    top_k = body.get("top_k", 40)
    top_k = 40 if top_k is None else top_k
    if not is_int(top_k) or top_k > MAX_INT32:
        raise bad_request(f"'top_k' must be an integer (0 or less: off), got {show(top_k)}", param="top_k")
    top_p = number_field(body, "top_p", 0.95, 0.0, 1.0, "in (0, 1]")
    if top_p <= 0.0:
        raise bad_request(f"'top_p' must be in (0, 1], got {show(top_p)}", param="top_p")
    min_p = number_field(body, "min_p", 0.05, 0.0, 1.0, "in [0, 1) (0 = off)")
    if min_p >= 1.0:
        raise bad_request(f"'min_p' must be in [0, 1) (0 = off), got {show(min_p)}", param="min_p")
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise bad_request(f"'seed' must be an integer (-1: random), got {show(seed)}", param="seed")
    repetition = number_field(body, "repeat_penalty", 1.0, 0.0, 100.0, "above 0 and at most 100 (1 = off)")
    if repetition <= 0.0:
        raise bad_request(f"'repeat_penalty' must be above 0 and at most 100 (1 = off), got {show(repetition)}",
                          param="repeat_penalty")
    stream = _flag(body, "stream")
    n_indent = body.get("n_indent", 0) or 0
    if not is_int(n_indent) or not 0 <= n_indent <= MAX_INT32:
        raise bad_request(f"'n_indent' must be an integer >= 0 (0 = off), got {show(n_indent)}", param="n_indent")
    t_max = number_field(body, "t_max_predict_ms", 0.0, 0.0, math.inf, ">= 0 (0 = off)")
    fields = body.get("response_fields")
    if fields is not None and (not isinstance(fields, list) or not all(isinstance(f, str) for f in fields)):
        raise bad_request("'response_fields' must be a list of field names, e.g. [\"content\", \"timings/prompt_n\"]",
                          param="response_fields")
    _check_hints(body)
    depth, sources = speculative_field(body.get("speculative"))
    req = CompletionRequest(
        "completion", model, texts["input_prefix"], None if limit is None or limit < 0 else int(limit), temperature,
        top_p, max(int(top_k), 0), None if seed is None or seed < 0 else int(seed), stop_field(body.get("stop")),
        stream, False, min_p=min_p,
        presence_penalty=number_field(body, "presence_penalty", 0.0, -2.0, 2.0, "between -2 and 2 (0 = off)"),
        frequency_penalty=number_field(body, "frequency_penalty", 0.0, -2.0, 2.0, "between -2 and 2 (0 = off)"),
        repetition_penalty=repetition, n=1, prompts=(texts["input_prefix"],), suffix=texts["input_suffix"],
        middle=texts["prompt"], repository=_extra(body.get("input_extra")), max_draft_depth=depth,
        token_sources=sources, cache_prompt=flag_field(body, "cache_prompt", True))
    return req, InfillOptions(int(n_indent), t_max, _flag(body, "return_tokens"),
                              None if fields is None else tuple(fields))


def _text(body: dict, name: str) -> str:
    value = body.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string, got {kind_of(value)}", param=name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {show(value)}", param=name)
    return value


def _extra(extra: Any) -> tuple[tuple[str, str], ...]:
    """``input_extra``: [{"filename": str, "text": str}] as (file name, text) pairs."""
    if extra is None:
        return ()
    if not isinstance(extra, list):
        raise bad_request(f"'input_extra' must be a list of {{\"filename\", \"text\"}} objects, got {kind_of(extra)}",
                          param="input_extra")
    out = []
    for i, chunk in enumerate(extra):
        ok = isinstance(chunk, dict) and not set(chunk) - {"filename", "text"} and isinstance(chunk.get("text"), str) \
            and isinstance(chunk.get("filename", ""), str)
        if not ok:
            raise bad_request(f"'input_extra[{i}]' must be {{\"filename\": string, \"text\": string}}, got "
                              f"{show(chunk)}", param=f"input_extra[{i}]")
        out.append((chunk.get("filename", ""), chunk["text"]))
    return tuple(out)


def _check_hints(body: dict) -> None:
    """The accepted, unapplied fields must still be of their types."""
    for name, ok, what in (("timings_per_token", lambda v: isinstance(v, bool), "true or false"),
                           ("id_slot", is_int, "an integer"),
                           ("t_max_prompt_ms", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                            "a number"),
                           ("samplers", lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
                            "a list of sampler names")):
        if body.get(name) is not None and not ok(body[name]):
            raise bad_request(f"'{name}' must be {what}, got {show(body[name])}", param=name)


class Cutter:
    """``n_indent`` and ``t_max_predict_ms`` applied to the middle as its text comes (module doc):
    ``feed`` returns what may be sent of it (the indentation of a line that may yet be cut is held
    back), ``rest`` what was held back at the end, ``text`` the middle so far; ``done`` says the
    generation may stop."""

    def __init__(self, options: InfillOptions):
        self.n_indent, self.t_max = options.n_indent, options.t_max_predict_ms
        self.text = ""
        self.done = False
        self._first: float | None = None
        self._line = 0  # where the line to check next begins (0: before the first newline)
        self._sent = 0  # characters of text returned so far

    def feed(self, piece: str) -> str:
        if self.done:
            return ""
        now = time.perf_counter()
        self._first = now if self._first is None else self._first
        text = self.text + piece
        if self.n_indent > 0:
            cut = self._dedent(text)
            if cut is not None:
                text, self.done = text[:cut], True
        if not self.done and self.t_max > 0 and "\n" in text and (now - self._first) * 1e3 > self.t_max:
            self.done = True
        self.text = text
        safe = len(text)
        if not self.done and self.n_indent > 0 and self._line and not text[self._line:].lstrip(" \t"):
            safe = self._line  # only indentation of this line so far: it may yet be cut
        out, self._sent = text[self._sent:safe], max(self._sent, safe)
        return out

    def rest(self) -> str:
        out, self._sent = self.text[self._sent:], len(self.text)
        return out

    def _dedent(self, text: str) -> int | None:
        """Where the first line indented less than n_indent begins (None: none yet)."""
        while True:
            if self._line == 0:
                nl = text.find("\n")
                if nl < 0:
                    return None
                self._line = nl + 1
            line = text[self._line:]
            body = line.lstrip(" \t")
            if not body:  # its first visible character has not come yet
                return None
            if body[0] != "\n" and len(line) - len(body) < self.n_indent:
                return self._line
            nl = line.find("\n")
            if nl < 0:
                return None
            self._line += nl + 1


def stopping_word(tokenizer, event: Finished, stops: Sequence[str]) -> str:
    """The stop string that ended ``event``'s text ("" if none did)."""
    if event.finish_reason != "stop" or not stops:
        return ""
    full = tokenizer.decode(event.token_ids, skip_special_tokens=True)
    return next((s for s in stops if full.startswith(s, len(event.text))), "")


def final_body(event: Finished, content: str, prompt_tokens: int, model: str, method: str, options: InfillOptions,
               stop_type: str, word: str) -> dict[str, Any]:
    """llama-server's last answer of an infill (the whole one, unstreamed)."""
    stats, n = event.stats, len(event.token_ids)
    cached = stats.cached_tokens if stats is not None else 0  # prompt tokens from the prefix cache
    prompt_ms = stats.prefill_s * 1e3 if stats is not None else 0.0
    predicted_ms = max(stats.wall_s - stats.prefill_s, 0.0) * 1e3 if stats is not None else 0.0
    body = {"index": 0, "content": content, "tokens": list(event.token_ids) if options.return_tokens else [],
            "id_slot": 0, "stop": True, "model": model, "tokens_predicted": n, "tokens_evaluated": prompt_tokens,
            "has_new_line": "\n" in content, "truncated": False, "stop_type": stop_type, "stopping_word": word,
            "tokens_cached": cached,
            "timings": {"cache_n": cached, "prompt_n": prompt_tokens - cached, "prompt_ms": prompt_ms,
                        "prompt_per_token_ms": prompt_ms / (prompt_tokens - cached) if prompt_tokens > cached else 0.0,
                        "prompt_per_second": (prompt_tokens - cached) / prompt_ms * 1e3 if prompt_ms else 0.0,
                        "predicted_n": n, "predicted_ms": predicted_ms,
                        "predicted_per_token_ms": predicted_ms / n if n else 0.0,
                        "predicted_per_second": n / predicted_ms * 1e3 if predicted_ms else 0.0},
            "speculative": speculative_usage(method, [stats] if stats is not None else [])}
    return body if options.response_fields is None else pick(body, options.response_fields)


def pick(body: dict, fields: Sequence[str]) -> dict:
    """``body``'s fields named in ``fields``; "a/b" reads body["a"]["b"] (under the key "a/b")."""
    out = {}
    for path in fields:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


async def infill_reply(ticket: Ticket, req: CompletionRequest, options: InfillOptions, *, model: str, method: str,
                       tokenizer, problem: Callable[[], str | None], gone, done: Callable[[int], None]):
    """The answer to one /infill request whose generation has started (``ticket``); ``done(status)``
    counts it in the metrics."""
    cutter = Cutter(options)

    def ending(event: Finished) -> dict:
        reason = "cancelled" if cutter.done else event.finish_reason
        word = stopping_word(tokenizer, event, req.stop)
        return final_body(event, cutter.text, ticket.prompt_tokens, model, method, options, STOP_TYPE[reason], word)

    if not req.stream:
        async with aclosing(merged([ticket], problem, gone)) as events:
            async for _, event in events:
                if isinstance(event, Failed):
                    done(event.status)
                    return error_of(event).response()
                if isinstance(event, Token):
                    cutter.feed(event.text)
                    if cutter.done:
                        ticket.cancel()
                elif isinstance(event, Finished):
                    done(200)
                    return JSONResponse(ending(event))
        done(500)
        return APIError(500, "the generation ended without its result", type="server_error").response()

    async def events():
        try:
            async with aclosing(merged([ticket], problem)) as source:
                count = 0
                async for _, event in source:
                    if isinstance(event, Token) and not cutter.done:
                        count += 1
                        piece = cutter.feed(event.text)
                        yield _event({"index": 0, "content": piece, "tokens": [event.token_id], "stop": False,
                                      "id_slot": 0, "tokens_predicted": count,
                                      "tokens_evaluated": ticket.prompt_tokens})
                        if cutter.done:
                            ticket.cancel()
                    elif isinstance(event, Finished):
                        rest = cutter.rest()
                        if rest:
                            yield _event({"index": 0, "content": rest, "tokens": [], "stop": False, "id_slot": 0,
                                          "tokens_predicted": count, "tokens_evaluated": ticket.prompt_tokens})
                        body = ending(event)
                        if "content" in body:
                            body["content"] = ""  # every piece was sent already
                        yield _event(body)
                        return
                    elif isinstance(event, Failed):
                        yield _event(error_of(event).body())
                        return
        except Exception as e:  # noqa: BLE001 -- the headers are sent: the fault goes in the stream
            yield _event(APIError(500, f"the request failed: {type(e).__name__}: {e}", type="server_error").body())
        finally:
            ticket.cancel()  # a no-op when it finished

    done(200)
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
