"""The public Python API: SpeculativeDecoder.generate / .stream over the decoding loop.

A decoder is built in named stages from a validated, frozen :class:`~speculant.config.DecoderConfig`:
resolve the "auto" choices for this machine and model (``defaults.resolve``), load the target and
draft on the chosen runtime (``loading``), load the heads, plan the tree and measure the pass cost
it is sized against (``drafters.factory``), then warm the heads up. Every generation gets a fresh
drafter from ``drafters.factory.build_drafter``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from .backends.base import Backend
from .backends.hf import HFBackend
from .backends.native import NativeBackend
from .config import BACKENDS, DEFAULT_HYDRA_TREE, DEFAULT_MAX_ROWS, METHODS, TREE_BUDGETS  # noqa: F401 (re-exported)
from .config import NEEDS_HEADS, DecoderConfig, SamplingConfig
from .decoding import Stats, decode
from .defaults import resolve
from .drafters.base import Drafter
from .drafters.factory import DraftParts, build_drafter, build_sizer, plan_tree, warm_up_heads
from .drafters.pacing import Pacer
from .errors import ConfigError
from .loading import auto_draft_quant, draft_keeps_dense, load_native  # noqa: F401 (re-exported)
from .loading import find_heads, load_decoder_heads, load_draft, load_target
from .models import LoadedModel, chat_prompt, check_vocab_compatible
from .sampling import make_generator

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
    finish_reason: str  # "eos" | "length"
    stats: Stats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": self.prompt_tokens,
                "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}


class SpeculativeDecoder:
    """Lossless speculative decoding of a target model, optionally with a draft model or heads.

    ``SpeculativeDecoder(config)`` with a :class:`~speculant.config.DecoderConfig`, or
    ``SpeculativeDecoder(target, draft=None, **options)`` with that config's fields as keyword
    arguments (``method``, ``gamma``, ``tree``, ``heads``, ``lookup_branch``, ``acceptance``,
    ``backend``, ``target_quant``, ``draft_quant``, ``tree_budget``, ``pacing``, ...; see the config
    for each). A bad option fails here with a ConfigError that says what to change, before any
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
        self.config, self.why = resolve(config)
        c = self.config
        self.target = load_target(c)
        heads_source = find_heads(c, self.target.name)
        self.draft = load_draft(c)
        if self.draft is not None:
            check_vocab_compatible(self.target, self.draft)
        self.tokenizer = self.target.tokenizer
        self.target_backend = _backend(c.backend, self.target, "target")
        self.draft_backend = _backend(c.backend, self.draft, "draft") if self.draft is not None else None
        self.vocab_size = min(b.vocab_size for b in (self.target_backend, self.draft_backend) if b)
        text_config = self.target.model.config.get_text_config()
        self.max_length = getattr(text_config, "max_position_embeddings", None)
        self.eos_token_ids = _eos_token_ids(self.target)
        self.heads = load_decoder_heads(heads_source, self.target.model, c.method) if c.method in NEEDS_HEADS else None
        self.tree, self.dynamic = plan_tree(c, heads_source, self.heads.num_heads if self.heads is not None else None)
        self.sizer = build_sizer(c, self.dynamic, self.target_backend, self.target.name, self.target.dtype)
        self._parts = DraftParts(self.tree, self.vocab_size, self.dynamic, self.sizer, self.draft_backend, self.heads)
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

    def encode(self, prompt: str | Sequence[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ConfigError("the prompt is empty: give some text to continue")
            text = chat_prompt(self.tokenizer, prompt) if self.chat else prompt
            ids = self.tokenizer(text, add_special_tokens=not self.chat, return_tensors="pt").input_ids[0]
        else:
            ids = torch.as_tensor(prompt, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise ConfigError("the prompt is empty: give at least one token")
        return ids

    def _embedding(self) -> torch.Tensor | None:
        """The target's input embeddings (V, H), for the distance acceptance rule only."""
        if self.acceptance.rule != "distance":
            return None
        return self.target.model.get_input_embeddings().weight[: self.vocab_size]

    def _drafter(self, sampling: SamplingConfig, generator) -> Drafter:
        return build_drafter(self.config, self._parts, sampling, generator)

    def _run(self, prompt, max_new_tokens, sampling: SamplingConfig):
        ids = self.encode(prompt)
        generator = make_generator(sampling.seed)
        drafter = self._drafter(sampling, generator)
        with torch.inference_mode():
            yield ids, None, None
            for state, step in decode(self.target_backend, drafter, ids, max_new_tokens=max_new_tokens,
                                      sampling=sampling, eos_token_ids=self.eos_token_ids,
                                      max_length=self.max_length, replacement=self.replacement,
                                      generator=generator, vocab_size=self.vocab_size,
                                      acceptance=self.acceptance, embedding=self._embedding(),
                                      pacer=Pacer() if self.pacing else None):
                yield ids, state, step

    def generate(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 128, *,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens; returns text, token ids and stats."""
        sampling = SamplingConfig(temperature, top_k, top_p, seed)
        state = None
        for ids, state, _ in self._run(prompt, max_new_tokens, sampling):
            pass
        gen = state.generated
        return GenerationResult(self.tokenizer.decode(gen, skip_special_tokens=True), gen,
                                int(ids.shape[0]), state.finish_reason, state.stats)

    def stream(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 128, *,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int | None = None) -> Iterator[TokenEvent]:
        """Yield tokens as they are accepted, each with its text and where it came from."""
        sampling = SamplingConfig(temperature, top_k, top_p, seed)
        gen: list[int] = []
        shown = ""
        self.last_stats, self.last_finish_reason = None, None  # set as the stream runs
        for _, state, step in self._run(prompt, max_new_tokens, sampling):
            if step is None:
                continue
            labelled = [(t, "draft") for t in step.accepted]
            if step.target_token >= 0:
                labelled.append((step.target_token, "target"))
            for tok, source in labelled:
                gen.append(tok)
                text = self.tokenizer.decode(gen, skip_special_tokens=True)
                # hold back an incomplete UTF-8 character until a later token completes it
                piece = text[len(shown):] if not text.endswith("\ufffd") else ""
                shown += piece
                yield TokenEvent(tok, piece, source)
            self.last_stats = state.stats
            self.last_finish_reason = state.finish_reason


def generate(prompt: str, target: str | LoadedModel, draft: str | LoadedModel | None = None, *,
             method: str = "auto", max_new_tokens: int = 128, **kwargs) -> GenerationResult:
    """One-shot convenience: build a decoder and generate."""
    sampling_keys = {"temperature", "top_k", "top_p", "seed"}
    gen_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in sampling_keys}
    return SpeculativeDecoder(target, draft, method=method, **kwargs).generate(
        prompt, max_new_tokens, **gen_kwargs)


def _backend(kind: str, model: LoadedModel, name: str) -> Backend:
    """The runtime ``kind`` ("hf" or "native") around a loaded model."""
    return (NativeBackend if kind == "native" else HFBackend)(model.model, name)


def _eos_token_ids(model: LoadedModel) -> set[int]:
    """The ids that end a generation: the model's generation config's, else its tokenizer's."""
    eos = model.model.generation_config.eos_token_id if model.model.generation_config else None
    eos = eos if eos is not None else model.tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}
