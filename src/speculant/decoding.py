"""The decoding loop: prefill, then draft → verify → accept → commit until done.

Notation (used in stats): p = target distribution, q = draft distribution, γ = draft length.
α (acceptance rate) = accepted draft tokens / drafted positions, where a step drafts one
position per tree depth (a chain of γ drafts γ positions, a tree of depth D drafts D: only one
path can be accepted). ``acceptance_by_depth[d]`` = P(depth d+1 accepted | depth d reached).
τ (tokens per call) = new tokens / target verification calls (the prefill is not counted).
Every step yields the accepted draft tokens plus one token from the target: the *bonus* token
when the path reached a leaf, the *recovered* token (sampled from the residual) otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .acceptance import mcss
from .approx import accept_tree_approx
from .backends.base import Backend
from .config import AcceptanceConfig, SamplingConfig
from .drafters.base import Draft, Drafter, HiddenNeed
from .drafters.pacing import Pacer
from .errors import ConfigError
from .sampling import logits_to_probs, sample
from .tree import chain


@dataclass
class Stats:
    target_calls: int = 0
    accepted_per_call: list[int] = field(default_factory=list)
    drafted_per_call: list[int] = field(default_factory=list)  # drafted positions (tree depth)
    drafted_by_depth: list[int] = field(default_factory=list)  # steps that reached depth d's parent
    accepted_by_depth: list[int] = field(default_factory=list)
    new_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0  # the target's prefill forward (part of verify_s)
    wall_s: float = 0.0
    plain_steps: int = 0  # steps verified as the root alone because drafting did not pay (drafters.pacing)
    acceptance: str = "exact"  # the rule that ran; anything but "exact" may change the output

    @property
    def tokens_per_call(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def acceptance_rate(self) -> float:
        proposed = sum(self.drafted_per_call)
        return sum(self.accepted_per_call) / proposed if proposed else 0.0

    def to_dict(self) -> dict:
        by_depth = [a / d if d else 0.0 for a, d in zip(self.accepted_by_depth, self.drafted_by_depth)]
        return {
            "acceptance": self.acceptance,
            "lossless": self.acceptance == "exact",
            "target_calls": self.target_calls,
            "tokens_per_call": self.tokens_per_call,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_by_depth": by_depth,
            "accepted_per_call": list(self.accepted_per_call),
            "drafted_positions": sum(self.drafted_per_call),
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "prefill_s": self.prefill_s,
            "other_s": max(self.wall_s - self.draft_s - self.verify_s, 0.0),
            "wall_s": self.wall_s,
            "plain_steps": self.plain_steps,
            "tokens_per_s": self.new_tokens / self.wall_s if self.wall_s else 0.0,
        }


@dataclass(frozen=True)
class Step:
    """What one step committed: accepted draft tokens, then the target's token (-1 when the
    block was cut at EOS or at max_new_tokens before it)."""
    accepted: list[int]
    target_token: int


@dataclass
class DecodeState:
    """All mutable state of one generation."""
    context: torch.Tensor  # (L,) long: prompt + generated so far
    prompt_len: int
    stats: Stats = field(default_factory=Stats)
    finish_reason: str | None = None

    @property
    def generated(self) -> list[int]:
        return self.context[self.prompt_len:].tolist()


def accept_tree(draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig, *,
                replacement: bool = True, generator: torch.Generator | None = None,
                acceptance: AcceptanceConfig | None = None, embedding: torch.Tensor | None = None,
                ) -> tuple[list[int], int]:
    """Walk the tree from the root; return the accepted path (node ids, root first) and the
    target's token after it. target_logits: (N, V) for every node of ``draft.tree``.
    ``acceptance``: None / exact = the lossless rules; otherwise ``approx.accept_tree_approx``
    (``embedding`` (V, H) for the distance rule)."""
    tree, tokens = draft.tree, draft.tokens
    if acceptance is not None and not acceptance.exact:
        return accept_tree_approx(tree, tokens, target_logits, sampling, acceptance,
                                  embedding=embedding, generator=generator)
    children = tree.children
    node, path = 0, [0]
    if sampling.greedy:
        # (N,) the target's argmax after each node. max() gives the first maximal index as argmax
        # does, ~3x faster on a (29, 151936) float tensor on CPU
        best = target_logits.max(-1).indices.tolist()
        toks, kids = tokens.tolist(), children.tolist()

        def longest(i: int) -> list[int]:  # the longest accepted path from node i (first of equals)
            out = [i]
            for c in kids[i]:
                if c >= 0 and toks[c] == best[i]:
                    sub = longest(c)
                    if len(sub) + 1 > len(out):
                        out = [i] + sub
            return out

        # Siblings may repeat a token (e.g. a lookup branch beside the heads' candidates): any
        # matching child gives the same output; the deepest match gives it in fewer steps.
        path = longest(0)
        return path, best[path[-1]]
    p = logits_to_probs(target_logits, sampling)  # (N, V)
    while True:
        kids = children[node]
        kids = kids[kids >= 0]
        if kids.numel() == 0:  # leaf: every drafted token on the path accepted -> bonus token
            return path, int(sample(p[node:node + 1], generator)[0])
        cands = tokens[kids].view(1, -1)  # (1, k)
        if draft.q is None:  # deterministic proposals: point masses tried in rank order (exact)
            i, residual = -1, p[node:node + 1]
            for j in range(cands.shape[1]):
                one = torch.zeros_like(residual).scatter_(1, cands[:, j:j + 1].clamp(min=0), 1.0)
                idx, residual = mcss(residual, one, cands[:, j:j + 1], replacement=True, generator=generator)
                if int(idx[0]) == 0:
                    i = j
                    break
        else:
            idx, residual = mcss(p[node:node + 1], draft.q[node:node + 1], cands,
                                 replacement=replacement, generator=generator)
            i = int(idx[0])
        if i < 0:  # every candidate rejected -> recovered token from the residual
            return path, int(sample(residual, generator)[0])
        node = int(kids[i])
        path.append(node)


def decode(target: Backend, drafter: Drafter, prompt: torch.Tensor, *, max_new_tokens: int,
           sampling: SamplingConfig, eos_token_ids: set[int] = frozenset(), max_length: int | None = None,
           replacement: bool = True, generator: torch.Generator | None = None,
           vocab_size: int | None = None, acceptance: AcceptanceConfig | None = None,
           embedding: torch.Tensor | None = None, pacer: Pacer | None = None) -> Iterator[tuple[DecodeState, Step]]:
    """Yield (state, step) after every step. ``prompt`` (T,) long, T >= 1. ``acceptance``: an
    approximate rule (off by default: None or exact is lossless); ``embedding`` (V, H) for the
    distance rule; ``pacer``: decides step by step whether drafting pays (else the step verifies
    the root alone; ``drafters.pacing``)."""
    if prompt.ndim != 1 or prompt.shape[0] < 1:
        raise ConfigError("the prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_length is not None and prompt.shape[0] >= max_length:
        raise ConfigError(
            f"the prompt has {prompt.shape[0]} tokens but the model's context is {max_length}: "
            "shorten the prompt")
    V = vocab_size or target.vocab_size
    state = DecodeState(prompt.clone(), prompt.shape[0])
    st = state.stats
    if acceptance is not None and not acceptance.exact:
        st.acceptance = acceptance.label
    t_start = time.perf_counter()
    # 0. prefill: the target caches every prompt token but the last (the first root)
    need = drafter.hidden_need
    target.reset()
    t = time.perf_counter()
    pre = None
    if prompt.shape[0] > 1:
        rows = torch.tensor([prompt.shape[0] - 2]) if need is not HiddenNeed.NONE else torch.empty(0, dtype=torch.long)
        pre = target.forward(prompt[:-1], rows=rows, want_hidden=need)
    st.prefill_s = time.perf_counter() - t
    st.verify_s += st.prefill_s
    drafter.begin(prompt, hidden=None if pre is None or pre.hidden is None else
                  pre.hidden[0] if need is HiddenNeed.LAST else pre.hidden)
    while state.finish_reason is None:
        # 1. draft (unless drafting does not pay now: then the root alone, as plain decoding)
        t = t_step = time.perf_counter()
        drafted = pacer is None or pacer.draft_now()
        draft = drafter.propose(state.context) if drafted else Draft(chain(0), state.context[-1:])
        st.plain_steps += not drafted
        t_draft = time.perf_counter()
        st.draft_s += t_draft - t
        # 2. verify: one target pass over the whole tree
        L = target.cache_length
        tree = draft.tree
        out = target.forward(draft.tokens.clamp(min=0), L + tree.depths, tree.mask,
                             want_hidden=HiddenNeed.NONE if need is HiddenNeed.NONE else HiddenNeed.LAST)
        st.verify_s += time.perf_counter() - t_draft
        st.target_calls += 1
        # 3. accept
        path, token = accept_tree(draft, out.logits[:, :V], sampling, replacement=replacement,
                                  generator=generator, acceptance=acceptance, embedding=embedding)
        # 4. commit: compact the accepted path's KV; tell the drafter
        target.compact(L, torch.tensor(path, dtype=torch.long))
        t = time.perf_counter()
        drafter.observe(path, token, hidden=None if out.hidden is None else
                        out.hidden[path[-1]] if need is HiddenNeed.LAST else out.hidden[path])
        st.draft_s += time.perf_counter() - t
        accepted = draft.tokens[path[1:]].tolist()
        _record(st, tree.depth, len(accepted))
        new = accepted + [token]
        # stop at EOS, at max_new_tokens, or at the context limit, mid-block if need be
        budget = max_new_tokens - st.new_tokens
        if max_length is not None:
            budget = min(budget, max_length - state.context.shape[0])
        for i, tok in enumerate(new[:budget]):
            if tok in eos_token_ids:
                new, state.finish_reason = new[:i + 1], "eos"
                break
        if len(new) >= budget and state.finish_reason is None:
            new = new[:budget]
            state.finish_reason = "length"
        st.new_tokens += len(new)
        state.context = torch.cat([state.context, torch.tensor(new, dtype=torch.long)])
        if pacer is not None:
            pacer.record(drafted, len(new), (time.perf_counter() - t_step) * 1e3)
        st.wall_s = time.perf_counter() - t_start
        n_draft = min(len(accepted), len(new))  # the block may have been cut short
        yield state, Step(new[:n_draft], new[n_draft] if len(new) > n_draft else -1)


def _record(st: Stats, depth: int, n_accepted: int) -> None:
    while len(st.drafted_by_depth) < depth:
        st.drafted_by_depth.append(0)
        st.accepted_by_depth.append(0)
    for d in range(min(n_accepted + 1, depth)):
        st.drafted_by_depth[d] += 1
    for d in range(n_accepted):
        st.accepted_by_depth[d] += 1
    st.accepted_per_call.append(n_accepted)
    st.drafted_per_call.append(depth)
