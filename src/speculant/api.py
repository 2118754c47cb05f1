"""The public Python API: SpeculativeDecoder.generate / .stream over the decoding loop.

A decoder is built in named stages from a validated, frozen :class:`~speculant.config.DecoderConfig`:
choose the runtime (``defaults.resolve_runtime``), load the target and draft on it (``store.loading``),
then let the planner decide the rest once the target runs (``planning.plan``: the method, the
heads, the tree and the pass cost it is sized against, and why), then warm the heads up. Every generation gets a fresh
drafter from ``drafters.factory.build_drafter``.
"""

from __future__ import annotations

import sys

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from .backends.base import Backend
from .backends.hf import HFBackend
from .backends.native import NativeBackend
from .config import BACKENDS, DEFAULT_HYDRA_TREE, DEFAULT_MAX_ROWS, METHODS, TREE_BUDGETS  # noqa: F401 (re-exported)
from .config import DecoderConfig, SamplingConfig
from .batching import Batch, Member
from .decoding import SequenceRun, Stats, decode
from .defaults import resolve_runtime
from .drafters.base import Drafter
from .drafters.factory import DraftParts, build_drafter, warm_up_heads
from .tuning.pacing import Pacer
from .errors import ConfigError
from .store.loading import auto_draft_quant, load_native  # noqa: F401 (re-exported)
from .store.loading import load_draft, load_target
from .store.lora import adapter_note
from .planning import Plan, plan  # noqa: F401 (Plan re-exported)
from .store.models import LoadedModel, chat_messages_prompt, chat_prompt, check_vocab_compatible
from .sampling import make_generator
from .stopping import StopStrings, parse_stop
from .text_check import check_text

@dataclass(frozen=True)
class TokenEvent:
    """One streamed token. source: "draft" (an accepted draft token) or "target"."""
    token_id: int
    text: str  # the new text this token completes (may be "" mid-character)
    source: str


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos" | "length" | "stop" (a stop string) | "cancelled"
    stats: Stats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": self.prompt_tokens,
                "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}


class SpeculativeDecoder:
    """Lossless speculative decoding of a target model, optionally with a draft model or heads.

    ``SpeculativeDecoder(config)`` with a :class:`~speculant.config.DecoderConfig`, or
    ``SpeculativeDecoder(target, draft=None, **options)`` with that config's fields as keyword
    arguments (``method``, ``gamma``, ``tree``, ``heads``, ``lookup_branch``, ``acceptance``,
    ``backend``, ``target_quant``, ``draft_quant``, ``tree_budget``, ``pacing``, ``lora``, ...; see
    the config for each). A bad option fails here with a ConfigError that says what to change, before any
    model is loaded where it can. Decoding cannot change the output (the target verifies every
    token) unless an approximate acceptance rule or a quantized target is asked for.

    Attributes: ``config`` (resolved: no "auto" left), ``why`` (what runs and why, one line),
    ``target`` / ``draft`` (LoadedModel), ``target_backend`` / ``draft_backend``, ``heads``,
    ``tree``, ``dynamic``, ``sizer``, ``vocab_size``, ``max_length``, ``eos_token_ids``.
    """

    def __init__(self, target: str | LoadedModel | DecoderConfig, draft: str | LoadedModel | None = None,
                 **options):
        if isinstance(target, DecoderConfig):
            if draft is not None or options:
                raise ConfigError("pass either a DecoderConfig or a target with keyword options, not both "
                                  "(dataclasses.replace(config, ...) changes a config)")
            config = target
        else:
            config = DecoderConfig.from_options(target, draft, **options)
        config, runtime = resolve_runtime(config)
        self.target = load_target(config)
        self.draft = load_draft(config)
        if self.draft is not None:
            check_vocab_compatible(self.target, self.draft)
            _warn_if_draft_larger(self.target, self.draft)
        self.tokenizer = self.target.tokenizer
        self.target_backend = _backend(config.backend, self.target, "target")
        self.plan = plan(config, runtime, self.target, self.target_backend)
        c = self.config = self.plan.config
        self.why = self.plan.why
        if note := adapter_note(self.plan.heads_source, c.lora):
            print(f"speculant: note: {note}", file=sys.stderr, flush=True)
        self.draft_backend = _backend(c.backend, self.draft, "draft") if self.draft is not None else None
        self.vocab_size = min(b.vocab_size for b in (self.target_backend, self.draft_backend) if b)
        text_config = self.target.model.config.get_text_config()
        self.max_length = getattr(text_config, "max_position_embeddings", None)
        native_limit = self.target_backend.model.max_context if isinstance(self.target_backend, NativeBackend) else 0
        if native_limit:  # a RoPE the native runtime runs up to its original context only
            self.max_length = min(self.max_length or native_limit, native_limit)
        self.eos_token_ids = _eos_token_ids(self.target)
        self.heads, self.tree, self.dynamic, self.sizer = self.plan.heads, self.plan.tree, self.plan.dynamic, \
            self.plan.sizer
        self._parts = DraftParts(self.tree, self.vocab_size, self.dynamic, self.sizer, self.draft_backend, self.heads)
        self._idle_targets = [self.target_backend]  # backends (KV caches) free for a sequence of a batch
        self.batch_pacer = Pacer()  # whether drafting pays while several sequences decode together (kept
        # across batches: what it learned about this machine and these models holds for the next one)
        self._idle_drafts = [self.draft_backend] if self.draft_backend is not None else []
        if self.heads is not None:
            self._drafter(SamplingConfig(), None)  # fail early: a tree deeper than the heads, gamma > K
            warm_up_heads(self.heads, self.vocab_size)

    # the resolved choices, as attributes
    method = property(lambda self: self.config.method)
    gamma = property(lambda self: self.config.gamma)
    lookup_branch = property(lambda self: self.config.lookup_branch)
    backend = property(lambda self: self.config.backend)
    replacement = property(lambda self: self.config.replacement)
    chat = property(lambda self: self.config.chat)
    acceptance = property(lambda self: self.config.acceptance)
    pacing = property(lambda self: self.config.pacing and self.config.method != "ar")

    def encode(self, prompt: str | Sequence[int] | Sequence[dict] | torch.Tensor) -> torch.Tensor:
        """The prompt's token ids (T,): a string (in the chat template as one user turn when
        ``chat`` is on), a list of chat messages (``{"role", "content"}``, always in the chat
        template), or token ids."""
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            text = chat_messages_prompt(self.tokenizer, prompt)
            ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
        elif isinstance(prompt, str):
            check_text(prompt, "the prompt")
            if not prompt.strip():
                raise ConfigError("the prompt is empty: give some text to continue")
            text = chat_prompt(self.tokenizer, prompt) if self.chat else prompt
            ids = self.tokenizer(text, add_special_tokens=not self.chat, return_tensors="pt").input_ids[0]
        else:
            try:
                ids = torch.as_tensor(prompt, dtype=torch.long).flatten()
            except (TypeError, ValueError, RuntimeError):
                raise ConfigError(f"cannot read the prompt ({type(prompt).__name__}) as token ids: give text, chat "
                                  "messages or a list of token ids") from None
            rows = self._input_rows()
            if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < rows):
                bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                raise ConfigError(f"the prompt's token id {bad} is outside the vocabulary (ids 0 to {rows - 1}): "
                                  "give ids of this model's tokenizer")
        if ids.numel() == 0:
            raise ConfigError("the prompt is empty: give at least one token")
        return ids

    def _input_rows(self) -> int:
        """How many token ids the models take as input (the smallest input embedding)."""
        models = [self.target] + ([self.draft] if self.draft is not None else [])
        return min(m.model.get_input_embeddings().weight.shape[0] for m in models)

    def _embedding(self) -> torch.Tensor | None:
        """The target's input embeddings (V, H), for the distance acceptance rule only."""
        if self.acceptance.rule != "distance":
            return None
        return self.target.model.get_input_embeddings().weight[: self.vocab_size]

    def _drafter(self, sampling: SamplingConfig, generator) -> Drafter:
        return build_drafter(self.config, self._parts, sampling, generator)

    def _loop_options(self, max_new_tokens: int, sampling: SamplingConfig, generator) -> dict:
        """The decoding loop's keywords for one generation (``decoding.SequenceRun``)."""
        return dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_token_ids=self.eos_token_ids,
                    max_length=self.max_length, replacement=self.replacement, generator=generator,
                    vocab_size=self.vocab_size, acceptance=self.acceptance, embedding=self._embedding(),
                    pacer=Pacer() if self.pacing else None)

    def _run(self, ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig):
        """The decoding loop's (state, step) after every step, for prompt ids ``ids`` (T,)."""
        generator = make_generator(sampling.seed)
        drafter = self._drafter(sampling, generator)
        with torch.inference_mode():
            yield from decode(self.target_backend, drafter, ids, **self._loop_options(max_new_tokens, sampling, generator))

    # ---- several sequences at once (batching.py) -------------------------------------------
    def join(self, batch: Batch, gen: "Generation",
             on_events: Callable[["Generation", list[TokenEvent]], None] | None = None,
             on_error: Callable[["Generation", Exception], None] | None = None) -> Member:
        """Add the generation ``gen`` (from ``start``) to ``batch``, on a target backend (KV cache)
        and drafter of its own; ``on_events(gen, events)`` after each of its steps (e.g. to stream
        them). It leaves the batch when it ends; ``leave`` takes one out earlier (a cancelled
        request). A fault of its own ends it alone: ``on_error(gen, exception)``, or without one
        the exception propagates from ``batch.step()``. Run the batch with ``batch.step()`` under
        ``torch.inference_mode()``."""
        target = self._idle_targets.pop() if self._idle_targets else self.target_backend.sibling()
        draft = None
        if self.draft_backend is not None:
            draft = self._idle_drafts.pop() if self._idle_drafts else self.draft_backend.sibling()
        generator = make_generator(gen.sampling.seed)
        drafter = build_drafter(self.config, self._parts, gen.sampling, generator, draft=draft, own_sizer=True)
        run = SequenceRun(target, drafter, gen.ids, **self._loop_options(gen.max_new_tokens, gen.sampling, generator))

        def on_step(member: Member, step) -> bool:
            events, done = gen.take(member.run.state, step)
            if on_events is not None:
                on_events(gen, events)
            if done:
                gen.finish()
                self._release(member)
            return done

        def failed(member: Member, error: Exception) -> None:
            gen.finish_reason = gen.finish_reason or "error"
            self._release(member)
            if on_error is None:
                raise error
            on_error(gen, error)

        member = batch.add(gen, run, on_step, failed)
        member.extra = (target, draft)
        return member

    def leave(self, batch: Batch, gen: "Generation") -> None:
        """Take ``gen`` out of ``batch`` now (it ends as "cancelled" if it had not ended)."""
        member = batch.remove(gen)
        if member is not None:
            gen.finish_reason = gen.finish_reason or "cancelled"
            gen.finish()
            self._release(member)

    def _release(self, member: Member) -> None:
        if member.extra is None:
            return
        target, draft = member.extra
        member.extra = None
        target.reset()
        self._idle_targets.append(target)
        if draft is not None:
            draft.reset()
            self._idle_drafts.append(draft)

    def generate_batch(self, prompts: Sequence, max_new_tokens: int = 128, *, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                       stop: str | Sequence[str] | None = None, max_batch: int | None = None) -> list[GenerationResult]:
        """``generate`` for every prompt, several sequences per target pass: one result per prompt,
        in order, each the one ``generate(prompt, ...)`` gives (the same options for all; with a
        ``seed``, each sequence samples as if generated alone with it). ``max_batch``: at most this
        many sequences decode together (default: all); the others join as sequences end. Every
        prompt and option is checked before any pass."""
        if max_batch is not None and max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        gens = [self.start(p, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                           stop=stop) for p in prompts]
        batch, waiting = Batch(max_batch, self.batch_pacer), list(gens)
        with torch.inference_mode():
            while waiting or len(batch):
                while waiting and not batch.full:
                    gen = waiting.pop(0)
                    gen.text_at_end()
                    self.join(batch, gen)
                batch.step()
        return [g.result() for g in gens]

    def start(self, prompt, max_new_tokens: int | None = 128, *, temperature: float = 0.0, top_k: int = 0,
              top_p: float = 1.0, seed: int | None = None, stop: str | Sequence[str] | None = None,
              cancel: Callable[[], bool] | None = None) -> "Generation":
        """A generation that has not run yet: iterate it for its tokens (``TokenEvent``), or call
        ``result()``. The prompt is encoded and every option checked here, before any pass.
        ``max_new_tokens`` None: up to the model's context (4,096 tokens where it states none)."""
        sampling = SamplingConfig(temperature, top_k, top_p, seed)
        ids = self.encode(prompt)
        if max_new_tokens is None:  # a prompt that fills the context is refused when the generation runs
            max_new_tokens = max(1, self.max_length - int(ids.shape[0])) if self.max_length else 4096
        return Generation(self, ids, max_new_tokens, sampling, StopStrings(parse_stop(stop)), cancel)

    def generate(self, prompt, max_new_tokens: int = 128, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None,
                 stop: str | Sequence[str] | None = None) -> GenerationResult | list[GenerationResult]:
        """Generate up to ``max_new_tokens`` tokens; returns text, token ids and stats. ``prompt``:
        text, chat messages or token ids (see ``encode``). ``stop``: up to 4 strings; the text
        ends right before the first of them (``finish_reason`` "stop"). A list of prompts
        (strings, token-id lists or message lists) runs them together (``generate_batch``) and
        returns a list of results."""
        if is_prompt_list(prompt):
            return self.generate_batch(prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                       seed=seed, stop=stop)
        return self.start(prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          seed=seed, stop=stop).result()

    def stream(self, prompt, max_new_tokens: int = 128, *, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop: str | Sequence[str] | None = None,
               cancel: Callable[[], bool] | None = None) -> Iterator[TokenEvent]:
        """Yield tokens as they are accepted, each with its text and where it came from. The texts
        add up to ``generate(...).text``. ``cancel``: polled after every step; when it returns
        True the generation ends after that step (``finish_reason`` "cancelled")."""
        gen = self.start(prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         seed=seed, stop=stop, cancel=cancel)
        self.last_stats, self.last_finish_reason = None, None  # set as the stream runs
        self.last_prompt_tokens = gen.prompt_tokens
        for event in gen:
            self.last_stats, self.last_finish_reason = gen.stats, gen.finish_reason
            yield event
        self.last_stats, self.last_finish_reason = gen.stats, gen.finish_reason


class Generation:
    """One generation of a decoder: iterating it runs the decoding loop and yields a
    ``TokenEvent`` per new token; ``token_ids``, ``text``, ``finish_reason`` and ``stats`` follow
    it. Text is held back while it may be the start of a stop string or of a multi-byte character,
    so the events' texts add up to ``text``. ``token_ids``: every token generated, up to the one
    that completed a stop string."""

    def __init__(self, decoder: SpeculativeDecoder, ids: torch.Tensor, max_new_tokens: int,
                 sampling: SamplingConfig, stops: StopStrings, cancel: Callable[[], bool] | None):
        self.decoder, self.ids, self.max_new_tokens, self.sampling = decoder, ids, max_new_tokens, sampling
        self.stops, self.cancel = stops, cancel
        self.prompt_tokens = int(ids.shape[0])
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stats: Stats | None = None
        self._texts = True  # decode the text after every token (a stream shows it as it grows)
        self._shown, self._checked = "", 0  # text shown by events so far; text scanned for stops so far

    def __iter__(self) -> Iterator[TokenEvent]:
        steps = self.decoder._run(self.ids, self.max_new_tokens, self.sampling)
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
            events.append(TokenEvent(tok, piece, source))
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
        return GenerationResult(self.text, list(self.token_ids), self.prompt_tokens, self.finish_reason, self.stats)


def generate(prompt: str, target: str | LoadedModel, draft: str | LoadedModel | None = None, *,
             method: str = "auto", max_new_tokens: int = 128, **kwargs) -> GenerationResult:
    """One-shot convenience: build a decoder and generate."""
    sampling_keys = {"temperature", "top_k", "top_p", "seed", "stop"}
    gen_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in sampling_keys}
    return SpeculativeDecoder(target, draft, method=method, **kwargs).generate(
        prompt, max_new_tokens, **gen_kwargs)


def is_prompt_list(prompt) -> bool:
    """Whether ``prompt`` is several prompts: a non-empty list or tuple of strings, of token-id
    lists (or tensors), or of chat-message lists — not one prompt's token ids or messages."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    return all(isinstance(p, str) for p in prompt) or all(isinstance(p, (list, tuple, torch.Tensor)) for p in prompt)


def _backend(kind: str, model: LoadedModel, name: str) -> Backend:
    """The runtime ``kind`` ("hf" or "native") around a loaded model."""
    return (NativeBackend if kind == "native" else HFBackend)(model.model, name)


def _size(model: LoadedModel) -> int:
    """A model's size as its transformer's shape says (layers x hidden^2): weights can be packed or
    quantized, which parameter counts would not see."""
    cfg = model.model.config.get_text_config()
    return int(getattr(cfg, "num_hidden_layers", 0)) * int(getattr(cfg, "hidden_size", 0)) ** 2


def _warn_if_draft_larger(target: LoadedModel, draft: LoadedModel) -> None:
    if _size(draft) > _size(target) > 0:
        print(f"speculant: warning: the draft model ({draft.name}) is larger than the target ({target.name}): "
              "every drafted token costs more than the target's own pass, so speculation will be slower than "
              "plain decoding (the output is the same); use a smaller draft, or --method lookup",
              file=sys.stderr, flush=True)


def _eos_token_ids(model: LoadedModel) -> set[int]:
    """The ids that end a generation: the model's generation config's, else its tokenizer's."""
    eos = model.model.generation_config.eos_token_id if model.model.generation_config else None
    eos = eos if eos is not None else model.tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}
