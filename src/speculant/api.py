"""The public Python API: SpeculativeDecoder.generate / .stream over the decoding loop.

A decoder is built in named stages from a validated, frozen :class:`~speculant.config.DecoderConfig`:
choose the runtime (``defaults.resolve_runtime``), load the target and draft on it (``store.loading``),
then let the planner decide the rest once the target runs (``planning.plan``: the method, the
heads, the tree and the pass cost it is sized against, and why), then warm the heads up. Every generation gets a fresh
drafter from ``drafters.factory.build_drafter``.
"""

from __future__ import annotations

import sys

from typing import Callable, Iterator, Sequence

import torch

from .backends.base import Backend
from .backends.hf import HFBackend
from .backends.native import NativeBackend
from .config import BACKENDS, DEFAULT_HYDRA_TREE, DEFAULT_MAX_ROWS, METHODS, TREE_BUDGETS  # noqa: F401 (re-exported)
from .config import DecoderConfig, SamplingConfig, default_cache_ram
from .batching import Batch, Member, run_alone
from .decoding import DecodeState, SequenceRun, Stats, Step, TokenLogprob, token_logprobs  # noqa: F401 (re-exported)
from .generation import Generation, GenerationResult, TokenEvent  # re-exported
from .penalties import Penalties
from .constraints import DEFAULT_ENGINE, Constraint, parse_response_format
from .grammars import CompiledGrammar, GrammarEngine, GrammarSpec, make_engine
from .defaults import resolve_runtime
from .drafters.base import Drafter
from .drafters.factory import DraftParts, build_drafter, warm_up_heads
from .tuning.pacing import Pacer
from .errors import ConfigError
from .store.loading import auto_draft_quant, load_native  # noqa: F401 (re-exported)
from .store.loading import load_draft, load_target
from .store.lora import adapter_note
from .planning import Plan, plan  # noqa: F401 (Plan re-exported)
from .store.chat import chat_messages_prompt, chat_prompt
from .store.models import LoadedModel, check_vocab_compatible
from .sampling import make_generator
from .stopping import StopStrings, parse_stop
from .text_check import check_text
from .runtime.prefix_cache import PrefixCache

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
        self.tokenizer = self.target.tokenizer
        self.target_backend = _backend(config.backend, self.target, "target")
        self.plan = plan(config, runtime, self.target, self.target_backend)
        c = self.config = self.plan.config
        self.why = self.plan.why
        self.draft = load_draft(c)  # after the plan: "auto" may choose the draft model
        if self.draft is not None:
            check_vocab_compatible(self.target, self.draft)
            _warn_if_draft_larger(self.target, self.draft)
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
        self._parts = DraftParts(self.tree, self.vocab_size, self.dynamic, self.sizer, self.draft_backend, self.heads,
                                 *_learned_parts(c, self.target, self.vocab_size))
        self._idle_targets = [self.target_backend]  # backends (KV caches) free for a sequence of a batch
        self.batch_pacer = Pacer()  # whether drafting pays while several sequences decode together (kept
        # across batches: what it learned about this machine and these models holds for the next one)
        self._idle_drafts = [self.draft_backend] if self.draft_backend is not None else []
        # every backend made, idle or in a batch (kv_memory_bytes); a tuple, replaced when one is added,
        # so that another thread may read it while the decoding thread works
        self._backends = tuple(b for b in (self.target_backend, self.draft_backend) if b is not None)
        self._grammar_engine: GrammarEngine | None = None  # built on the first response_format
        self._grammars: dict[GrammarSpec, CompiledGrammar] = {}  # compiled, most recent last
        # KV entries of earlier prompts and answers, shared by every generation (native runtime only)
        mib = default_cache_ram() if c.cache_ram is None else c.cache_ram
        self.prefix_cache = PrefixCache(mib * 2**20) if mib and isinstance(self.target_backend, NativeBackend) \
            else None
        # With the cache, prompts run on the decoding kernels (an answer from the cache is then the cold
        # answer, bit for bit), unless the prefill kernels widen the weights (AMX), which changes the
        # bits anyway and is worth far more than the prompt attention's flash kernel
        self.exact_prompts = self.prefix_cache is not None and not self.target_backend.widened_prefill
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
    pacing = property(lambda self: self.config.pacing and self.config.spec.drafts)

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

    def _sequence(self, gen: Generation, target: Backend, draft: Backend | None = None,
                  own_sizer: bool = False) -> SequenceRun:
        """The decoding loop of the generation ``gen`` on ``target`` (a backend of its own: its KV
        cache) with a fresh drafter; ``draft``: the draft model's backend of its own (default: the
        decoder's); ``own_sizer``: a fork of the tree sizer (a sequence decoded beside others)."""
        sampling = gen.sampling
        generator = make_generator(sampling.seed)
        constraint = self._constraint(gen.grammar)
        drafter = build_drafter(self.config, self._parts, sampling, generator, draft=draft, own_sizer=own_sizer,
                                constraint=constraint, prediction=gen.prediction)
        return SequenceRun(target, drafter, gen.ids, max_new_tokens=gen.max_new_tokens, sampling=sampling,
                           eos_token_ids=self.eos_token_ids | gen.end_tokens, max_length=self.max_length,
                           replacement=self.replacement, generator=generator, vocab_size=self.vocab_size,
                           acceptance=self.acceptance, embedding=self._embedding(),
                           pacer=Pacer() if self.pacing else None, logprobs=gen.logprobs_top, constraint=constraint,
                           max_draft_depth=gen.max_draft_depth,
                           prefix_cache=self.prefix_cache if gen.cache_prompt else None,
                           fast_prefill=not self.exact_prompts)

    def steps(self, gen: Generation) -> Iterator[tuple[DecodeState, Step]]:
        """The decoding loop's (state, step) after every step of the generation ``gen`` (from
        ``start``) decoded alone, a batch of one: what iterating ``gen`` runs."""
        run = self._sequence(gen, self.target_backend)
        with torch.inference_mode():
            try:
                yield from run_alone(run)
            except GeneratorExit:  # ended between steps (a stop string, a cancel): its context is whole
                run.remember()
                raise

    # ---- constrained decoding (constraints.py, grammars.py) --------------------------------
    MAX_CACHED_GRAMMARS = 64

    def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """``spec`` compiled for this decoder's tokenizer (cached: a server sees the same schema
        again and again); a bad grammar raises ConfigError."""
        if spec in self._grammars:
            self._grammars[spec] = self._grammars.pop(spec)  # most recently used last
            return self._grammars[spec]
        if self._grammar_engine is None:
            self._grammar_engine = make_engine(DEFAULT_ENGINE, self.tokenizer, self.vocab_size, self.eos_token_ids)
        compiled = self._grammar_engine.compile(spec)
        self._grammars[spec] = compiled
        while len(self._grammars) > self.MAX_CACHED_GRAMMARS:
            self._grammars.pop(next(iter(self._grammars)))
        return compiled

    def _constraint(self, grammar: CompiledGrammar | None) -> Constraint | None:
        """A generation's grammar state, at the grammar's start (None: free text)."""
        return None if grammar is None else Constraint.start(grammar, self.vocab_size, self.eos_token_ids)

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
        target = self._spare(self._idle_targets, self.target_backend)
        draft = None
        if self.draft_backend is not None:
            draft = self._spare(self._idle_drafts, self.draft_backend)
        run = self._sequence(gen, target, draft, own_sizer=True)

        def on_step(member: Member, step) -> bool:
            events, done = gen.take(member.run.state, step)
            if on_events is not None:
                on_events(gen, events)
            if done:
                gen.finish()
                member.run.remember()  # (a run that ended by itself already did)
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
            if member.prefilled:  # between steps: its cache holds its context's entries
                member.run.remember()
            gen.finish_reason = gen.finish_reason or "cancelled"
            gen.finish()
            self._release(member)

    def _spare(self, idle: list, first: Backend) -> Backend:
        """An idle backend of ``idle``, or a new sibling of ``first`` (kept in ``_backends``)."""
        if idle:
            return idle.pop()
        backend = first.sibling()
        self._backends = self._backends + (backend,)
        return backend

    def kv_memory_bytes(self) -> int:
        """The KV memory this decoder holds: the cache slabs of every target and draft backend it
        has made (idle ones included: they keep their slabs for the next sequence) plus the prefix
        cache's blocks. Safe to call from another thread (it reads sizes, nothing it iterates changes)."""
        pc = self.prefix_cache
        return sum(b.cache.nbytes for b in self._backends) + (pc.bytes if pc is not None else 0)

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

    def prompt_logprobs(self, ids: torch.Tensor, top: int = 0, chunk: int = 128) -> tuple[TokenLogprob | None, ...]:
        """Each prompt token's log-probability under the target given the tokens before it, and
        the ``top`` most likely tokens there (:class:`TokenLogprob`; None for the first token, which
        nothing predicts): what OpenAI's ``echo`` with ``logprobs`` reports. ``ids`` (T,): the
        prompt's token ids (``encode``). One pass over the prompt on a KV cache of its own, ``chunk``
        rows of logits at a time."""
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        backend = self._spare(self._idle_targets, self.target_backend)
        out: list[TokenLogprob | None] = [None]
        try:
            backend.reset()
            with torch.inference_mode():
                for a in range(0, ids.shape[0] - 1, chunk):
                    rows = ids[a:min(a + chunk, ids.shape[0] - 1)]  # each predicts the token after it
                    logits = backend.forward(rows).logits  # (n, V)
                    nxt = ids[a + 1:a + 1 + rows.shape[0]].tolist()
                    out += token_logprobs(logits[:, :self.vocab_size], list(range(len(nxt))), nxt, top)
        finally:
            backend.reset()
            self._idle_targets.append(backend)
        return tuple(out)

    def generate_batch(self, prompts: Sequence, max_new_tokens: int = 128, *, max_batch: int | None = None,
                       **options) -> list[GenerationResult]:
        """``generate`` for every prompt, several sequences per target pass: one result per prompt,
        in order, each the one ``generate(prompt, ...)`` gives (the same ``options``, ``start``'s,
        for all; with a ``seed``, each sequence samples as if generated alone with it).
        ``max_batch``: at most this many sequences decode together (default: all); the others join
        as sequences end. Every prompt and option is checked before any pass."""
        if max_batch is not None and max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        gens = [self.start(p, max_new_tokens, **options) for p in prompts]
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
              cancel: Callable[[], bool] | None = None, min_p: float = 0.0, presence_penalty: float = 0.0,
              frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
              logit_bias: dict[int, float] | None = None, logprobs: int | None = None,
              response_format: dict | None = None, max_draft_depth: int | None = None,
              prediction: str | Sequence[int] | None = None, end_tokens: Sequence[int] = (),
              cache_prompt: bool = True) -> Generation:
        """A generation that has not run yet: iterate it for its tokens (``TokenEvent``), or call
        ``result()``. The prompt is encoded and every option checked here, before any pass.
        ``max_new_tokens`` None: up to the model's context (4,096 tokens where it states none).
        ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``: ``config.SamplingConfig``;
        ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``logit_bias`` ({token
        id: bias}): ``penalties.Penalties``, applied to the target's distribution at every verified
        node, so speculation stays exact for the penalised distribution. ``stop``: up to 4
        strings; the text ends right before the first of them (``finish_reason`` "stop").
        ``cancel``: polled after every step; True ends the generation (``finish_reason``
        "cancelled"). ``logprobs``: None, or k from 0 to 20: each token's log-probability under the
        target model and the k most likely tokens at its position (``TokenEvent.logprob``,
        ``GenerationResult.logprobs``). ``response_format``: OpenAI's ``{"type": "text"}``,
        ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name", "schema",
        "strict"}}``, or ``{"type": "regex", "regex": ...}`` / ``{"type": "grammar", "grammar": <Lark
        or GBNF>}``: the output matches it (``constraints``: the target's distribution is masked at
        every verified node, so speculation stays exact for the masked distribution); it ends
        with ``finish_reason`` "stop" where the grammar allows nothing more, "eos" where the model
        ends a text the grammar may end. ``max_draft_depth``: None, or k >= 0: this generation's
        drafts are cut to k tokens deep (0: plain decoding, one token per target pass); the output
        is the same for every k (the verification is unchanged), only the speed differs.
        ``prediction``: text (or token ids) the output is expected to be, mostly (OpenAI's Predicted
        Outputs: a file being edited, an answer being revised); prompt lookup searches it for
        drafts (``drafters.factory``), which the target verifies like any other, so the output is
        unchanged; ``Stats.prediction_accepted`` / ``prediction_rejected`` count its draft tokens
        the target accepted / refused. ``end_tokens``: token ids that end this generation too
        (``finish_reason`` "eos"), beside the model's end-of-sequence tokens (a fill-in-the-middle
        prompt's markers). ``cache_prompt``: False keeps this generation out of the prefix cache
        (its prompt is prefilled whole, and nothing of it is kept); ``Stats.cached_tokens``: the
        prompt tokens it took from there."""
        bias = tuple(sorted(_logit_bias(logit_bias).items()))
        penalties = Penalties(presence_penalty, frequency_penalty, repetition_penalty, bias)
        penalties.check_vocab(self.vocab_size)
        sampling = SamplingConfig(temperature, top_k, top_p, seed, min_p, penalties)
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise ConfigError(f"logprobs must be None or an integer from 0 to {MAX_TOP_LOGPROBS} (the top tokens "
                              f"reported at each position), got {logprobs!r}")
        if max_draft_depth is not None and (isinstance(max_draft_depth, bool) or not isinstance(max_draft_depth, int)
                                            or max_draft_depth < 0):
            raise ConfigError(f"max_draft_depth must be None or an integer >= 0 (0: plain decoding), got "
                              f"{max_draft_depth!r}")
        spec = parse_response_format(response_format)
        if spec is not None and not self.acceptance.exact:
            raise ConfigError(f"response_format needs the exact acceptance rule: {self.acceptance.label} may accept "
                              "tokens the grammar forbids")
        grammar = self.compile_grammar(spec) if spec is not None else None
        ids = self.encode(prompt)
        predicted = self._prediction_ids(prediction)
        ends = frozenset(self._token_ids(end_tokens, "end_tokens"))
        if max_new_tokens is None:  # a prompt that fills the context is refused when the generation runs
            max_new_tokens = max(1, self.max_length - int(ids.shape[0])) if self.max_length else 4096
        return Generation(self, ids, max_new_tokens, sampling, StopStrings(parse_stop(stop)), cancel, logprobs,
                          grammar, max_draft_depth, prediction=predicted, end_tokens=ends,
                          cache_prompt=bool(cache_prompt))

    def _prediction_ids(self, prediction) -> torch.Tensor | None:
        """``start``'s ``prediction`` as token ids (None: none, or empty)."""
        if prediction is None:
            return None
        if isinstance(prediction, str):
            check_text(prediction, "the prediction")
            ids = self.tokenizer(prediction, add_special_tokens=False).input_ids if prediction else []
        else:
            ids = self._token_ids(prediction, "prediction")
        return torch.tensor(ids, dtype=torch.long) if ids else None

    def _token_ids(self, ids, what: str) -> list[int]:
        """``ids`` as a list of token ids of the vocabulary, or a ConfigError naming ``what``."""
        if isinstance(ids, torch.Tensor):
            ids = ids.flatten().tolist()
        elif isinstance(ids, (set, frozenset)):
            ids = sorted(ids)
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ConfigError(f"{what} must be a list of token ids, got {type(ids).__name__}")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(f"{what} has the token id {bad[0]}, "
                              f"outside the vocabulary (ids 0 to {self.vocab_size - 1})")
        return list(ids)

    def generate(self, prompt, max_new_tokens: int = 128, **options) -> GenerationResult | list[GenerationResult]:
        """Generate up to ``max_new_tokens`` tokens; returns text, token ids and stats. ``prompt``:
        text, chat messages or token ids (see ``encode``); ``options``: ``start``'s (temperature,
        top_k, top_p, min_p, seed, stop, the penalties, logit_bias, logprobs, response_format). A list of prompts
        (strings, token-id lists or message lists) runs them together (``generate_batch``) and
        returns a list of results."""
        if is_prompt_list(prompt):
            return self.generate_batch(prompt, max_new_tokens, **options)
        return self.start(prompt, max_new_tokens, **options).result()

    def stream(self, prompt, max_new_tokens: int = 128, **options) -> Iterator[TokenEvent]:
        """Yield tokens as they are accepted, each with its text and where it came from. The texts
        add up to ``generate(...).text``. ``options``: ``start``'s (``cancel`` among them)."""
        gen = self.start(prompt, max_new_tokens, **options)
        self.last_stats, self.last_finish_reason = None, None  # set as the stream runs
        self.last_prompt_tokens = gen.prompt_tokens
        for event in gen:
            self.last_stats, self.last_finish_reason = gen.stats, gen.finish_reason
            yield event
        self.last_stats, self.last_finish_reason = gen.stats, gen.finish_reason


MAX_TOP_LOGPROBS = 20  # as OpenAI's API


def _logit_bias(bias) -> dict[int, float]:
    """``logit_bias`` ({token id: bias}, ids possibly as strings, as JSON gives them) as ints and floats."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ConfigError(f"logit_bias must be a mapping of token ids to biases, got {type(bias).__name__}")
    out = {}
    for k, v in bias.items():
        try:
            tok = int(k)
            val = float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"logit_bias maps token ids to numbers, got {k!r}: {v!r}") from None
        if isinstance(v, bool) or val != val:
            raise ConfigError(f"logit_bias maps token ids to numbers, got {k!r}: {v!r}")
        out[tok] = val
    return out


def generate(prompt: str, target: str | LoadedModel, draft: str | LoadedModel | None = None, *,
             method: str = "auto", max_new_tokens: int = 128, **kwargs) -> GenerationResult:
    """One-shot convenience: build a decoder and generate."""
    sampling_keys = {"temperature", "top_k", "top_p", "seed", "stop", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "response_format",
                     "max_draft_depth", "prediction", "end_tokens"}
    gen_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in sampling_keys}
    return SpeculativeDecoder(target, draft, method=method, **kwargs).generate(
        prompt, max_new_tokens, **gen_kwargs)


def is_prompt_list(prompt) -> bool:
    """Whether ``prompt`` is several prompts: a non-empty list or tuple of strings, of token-id
    lists (or tensors), or of chat-message lists — not one prompt's token ids or messages."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    return all(isinstance(p, str) for p in prompt) or all(isinstance(p, (list, tuple, torch.Tensor)) for p in prompt)


def _learned_parts(config: DecoderConfig, target: LoadedModel, vocab_size: int) -> tuple:
    """(table, answers) for the methods that learn from use (suffix, recycle), else (None, None):
    the recycled table loaded from the model's cache file, and an empty answer store."""
    kind = config.spec.drafter
    if kind not in ("suffix", "recycle"):
        return None, None
    from .drafters.recycling import DEFAULT_K, RecycledTable, table_path
    from .drafters.suffix import AnswerStore

    table = RecycledTable.load_or_new(vocab_size, DEFAULT_K, table_path(target.name, target.path, vocab_size,
                                                                         DEFAULT_K)) if kind == "recycle" else None
    return table, AnswerStore()


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
