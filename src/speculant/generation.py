"""One generation of a decoder (:class:`Generation`), what it streams (:class:`TokenEvent`) and
what it returns (:class:`GenerationResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from .config import SamplingConfig
from .decoding import Stats, TokenLogprob
from .stopping import StopStrings

if TYPE_CHECKING:
    from .api import SpeculativeDecoder
    from .grammars import CompiledGrammar

__all__ = ["Generation", "GenerationResult", "TokenEvent"]


@dataclass(frozen=True)
class TokenEvent:
    """One streamed token. source: "draft" (an accepted draft token) or "target"."""
    token_id: int
    text: str  # the new text this token completes (may be "" mid-character)
    source: str
    logprob: TokenLogprob | None = None  # with logprobs asked for: the target's log-probability of it


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos" | "length" | "stop" (a stop string, or the grammar's end) | "cancelled"
    stats: Stats
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)  # one per token id, if asked for

    def to_dict(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": self.prompt_tokens,
               "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [{"logprob": lp.logprob, "top": [list(t) for t in lp.top]} for lp in self.logprobs]
        return out


class Generation:
    """One generation of a decoder: iterating it runs the decoding loop and yields a
    ``TokenEvent`` per new token; ``token_ids``, ``text``, ``finish_reason`` and ``stats`` follow
    it. Text is held back while it may be the start of a stop string or of a multi-byte character,
    so the events' texts add up to ``text``. ``token_ids``: every token generated, up to the one
    that completed a stop string."""

    def __init__(self, decoder: SpeculativeDecoder, ids: torch.Tensor, max_new_tokens: int,
                 sampling: SamplingConfig, stops: StopStrings, cancel: Callable[[], bool] | None,
                 logprobs: int | None = None, grammar: CompiledGrammar | None = None,
                 max_draft_depth: int | None = None, prediction: torch.Tensor | None = None,
                 end_tokens: frozenset[int] = frozenset(), cache_prompt: bool = True):
        self.decoder, self.ids, self.max_new_tokens, self.sampling = decoder, ids, max_new_tokens, sampling
        self.max_draft_depth = max_draft_depth  # None: the decoder's drafts; 0: plain decoding
        self.prediction = prediction  # token ids the output is expected to be (drafted from), or None
        self.cache_prompt = cache_prompt  # False: no prefix cache for this generation
        self.end_tokens = end_tokens  # token ids that end it beside the model's end-of-sequence ones
        self.grammar = grammar  # the compiled response_format, or None (free text)
        self.stops, self.cancel = stops, cancel
        self.logprobs_top = logprobs  # None: no logprobs; k: each token's and the top k
        self.logprobs: list[TokenLogprob] | None = [] if logprobs is not None else None
        self.prompt_tokens = int(ids.shape[0])
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stats: Stats | None = None
        self._texts = True  # decode the text after every token (a stream shows it as it grows)
        self._shown, self._checked = "", 0  # text shown by events so far; text scanned for stops so far

    def __iter__(self) -> Iterator[TokenEvent]:
        steps = self.decoder.steps(self)
        try:
            for state, step in steps:
                events, done = self.take(state, step)
                yield from events
                if done:
                    return
        finally:
            steps.close()
            self.finish()

    @property
    def shown(self) -> str:
        """The text the events so far have carried (``text`` less what is still held back)."""
        return self._shown

    def text_at_end(self) -> None:
        """Decode the text once at the end instead of after every token (no events need it:
        a batch's result); stop strings are still scanned as the tokens come."""
        self._texts = False

    def take(self, state, step) -> tuple[list[TokenEvent], bool]:
        """One decoding step's tokens (``state``, ``step``: what the decoding loop yields): their
        events, and whether the generation ends with them."""
        self.stats = state.stats
        events: list[TokenEvent] = []
        ending = state.finish_reason is not None or (self.cancel is not None and self.cancel())
        labelled = [(t, "draft") for t in step.accepted]
        if step.target_token >= 0:
            labelled.append((step.target_token, "target"))
        for n, (tok, source) in enumerate(labelled, 1):
            self.token_ids.append(tok)
            lp = step.logprobs[n - 1] if step.logprobs else None
            if self.logprobs is not None and lp is not None:
                self.logprobs.append(lp)
            if not (self._texts or self.stops.strings):
                continue
            text = self.decoder.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            hit = self.stops.scan(text, self._checked)
            self._checked = len(text.rstrip("\ufffd"))
            final = hit is not None or (ending and n == len(labelled))
            if hit is not None:
                self.text, self.finish_reason = text[:hit], "stop"
                visible = self.text
            else:
                self.text = text
                # hold back an incomplete UTF-8 character and a possible start of a stop string
                visible = text if final else text[:self.stops.safe_length(text.rstrip("\ufffd"))]
            piece = visible[len(self._shown):] if len(visible) > len(self._shown) else ""
            self._shown += piece
            if final and self.finish_reason is None:
                self.finish_reason = state.finish_reason or "cancelled"
            events.append(TokenEvent(tok, piece, source, lp))
            if final:
                return events, True
        if ending:  # the step ended the generation without a token to carry its text
            self.finish_reason = state.finish_reason or "cancelled"
            return events, True
        return events, False

    def finish(self) -> None:
        """After the last step: the text, where no event carried it."""
        if not (self._texts or self.stops.strings) and self.finish_reason is not None:
            self.text = self.decoder.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def result(self) -> GenerationResult:
        """Run the generation to its end (if not yet) and return its result."""
        if self.finish_reason is None:
            self.text_at_end()
            for _ in self:
                pass
        logprobs = None if self.logprobs is None else self.logprobs[:len(self.token_ids)]
        return GenerationResult(self.text, list(self.token_ids), self.prompt_tokens, self.finish_reason, self.stats,
                                logprobs)


