"""Shared test helpers: decoding a prompt to the end with any backend and drafter."""

from __future__ import annotations

import torch

from speculant.backends.hf import HFBackend
from speculant.config import SamplingConfig
from speculant.decoding import DecodeState, decode

GREEDY = SamplingConfig()


def decode_to_end(target, drafter, prompt: torch.Tensor, n: int = 40, *, eos=(), sampling: SamplingConfig = GREEDY,
                  **options) -> DecodeState:
    """Run the decoding loop on ``prompt`` (T,) long until it stops (EOS in ``eos``, or ``n`` new
    tokens); return the final state. ``target``: a Backend, or a transformers model (wrapped in an
    HFBackend); ``options``: the rest of ``decode``'s keywords (generator, replacement, acceptance,
    pacer, ...)."""
    backend = HFBackend(target) if isinstance(target, torch.nn.Module) else target
    state = None
    for state, _ in decode(backend, drafter, prompt, max_new_tokens=n, sampling=sampling,
                           eos_token_ids=set(eos), **options):
        pass
    return state


# ---- sampling checked by the probability integral transform --------------------------------
#
# Every token a lossless method emits is drawn from the target's distribution given everything
# before it. So with the exact conditional p_t of each emitted token x_t (one teacher-forced pass
# of the target over the finished sequence), the randomized probability integral transform
# U_t = P(X < x_t) + W p_t(x_t), W ~ U(0, 1), is uniform on (0, 1) and independent across tokens:
# long generations give many samples. ``uniformity`` scores them: a chi-square test and the total
# variation of 20 bins against uniform.

def greedy_records(target, count: int, answer: int, vocab: int, seed: int = 5, prompt_len: int = 6) -> list[dict]:
    """``count`` corpus records (make-corpus's shape) of the target's own greedy ``answer``-token
    answers to random prompts of ``prompt_len`` tokens below ``vocab``."""
    from speculant.drafters.base import NoDrafter

    g = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(count):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g)
        generated = decode_to_end(target, NoDrafter(), prompt, n=answer).generated
        records.append({"prompt": "", "prompt_len": prompt_len, "ids": prompt.tolist() + generated})
    return records


def pit_batched(target, make_drafter, prompts, tokens: int, *, temperature: float = 1.0, width: int = 32,
                per_seq: int = 100, seed: int = 99, **options) -> torch.Tensor:
    """``tokens`` PIT values (against ``target``, a transformers model, at temperature 1) of the
    generations of ``make_drafter(generator)`` drafters on the native runtime, ``width`` sequences
    per pass (``batching``), the ``prompts`` taking turns. ``options``: more of ``SequenceRun``'s
    keywords (acceptance, ...)."""
    from speculant.backends.native import NativeBackend
    from speculant.batching import Batch
    from speculant.decoding import SequenceRun

    tb = NativeBackend(target)
    sampling = SamplingConfig(temperature=temperature)
    gen, noise = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    idle = [tb.sibling() for _ in range(width)]
    batch, started, us = Batch(width), 0, []
    with torch.inference_mode():
        while sum(u.numel() for u in us) < tokens:
            while idle:
                t = idle.pop()
                run = SequenceRun(t, make_drafter(gen), prompts[started % len(prompts)], max_new_tokens=per_seq,
                                  sampling=sampling, generator=gen, **options)
                batch.add(started, run).extra = t
                started += 1
            before = list(batch.members)
            batch.step()
            for m in before:
                if m not in batch.members:
                    ids, n0 = m.run.state.context, m.run.prompt.shape[0]
                    p = target(ids[:-1].view(1, -1)).logits[0, n0 - 1:].float().softmax(-1)  # (n, V)
                    x = ids[n0:]
                    below = (p.cumsum(-1) - p).gather(1, x[:, None])[:, 0]
                    us.append(below + torch.rand(x.shape[0], generator=noise) * p.gather(1, x[:, None])[:, 0])
                    idle.append(m.extra)
    return torch.cat(us)[:tokens]


def uniformity(u: torch.Tensor, bins: int = 20) -> tuple[float, float]:
    """(chi-square p-value, total variation) of ``u``'s histogram against uniform."""
    from scipy.stats import chisquare
    counts = torch.histc(u.float(), bins=bins, min=0.0, max=1.0)
    return chisquare(counts.numpy()).pvalue, 0.5 * (counts / counts.sum() - 1 / bins).abs().sum().item()


def assert_tree_pass_is_one_token_passes(backend, context: torch.Tensor, tree, tokens: torch.Tensor) -> None:
    """After ``context`` (C,), one pass over the tree ``tree`` of ``tokens`` (tree.size,) gives each
    node bit for bit the logits of one-token passes down its own path (row invariance)."""
    C = context.shape[0]
    backend.forward(context, rows=torch.empty(0, dtype=torch.long))
    wide = backend.forward(tokens, C + tree.depths, tree.mask).logits
    for node in range(tree.size):
        path = [i for i in range(tree.size) if tree.mask[node, i]]  # its ancestors and itself, in order
        backend.rollback(C)
        for j in path:
            out = backend.forward(tokens[j:j + 1]).logits[0]
        assert torch.equal(out, wide[node]), node
