"""Exact sampling for the methods that draft from heads: Medusa and Hydra heads on static trees
with a prompt-lookup branch and on cost-sized dynamic trees with the lookup chain merged in, the
EAGLE drafter's cost-sized dynamic tree, and blockwise parallel decoding. Heads (distilled briefly
on the target's own samples, so that many of their drafts are accepted) propose
deterministic tokens (point masses); the exact rule accepts a drafted token x with probability
p(x) and otherwise samples the residual, so every emitted token must
follow the target's conditional distribution. Checked on 100,000 emitted tokens per method by the
probability integral transform against the target's exact conditionals (helpers.pit_batched):
chi-square and total variation against uniform. Negative control per method: the same drafts
under Medusa's typical acceptance (an approximate rule that accepts any likely-enough draft)
must fail the same check."""

from __future__ import annotations

import pytest
import torch

from speculant.config import AcceptanceConfig
from speculant.tuning.costmodel import PassCost
from speculant.drafters.dynamic_tree import DynamicTree, DynamicTreeDrafter
from speculant.drafters.lookup import LookupDrafter
from speculant.tuning.sizing import TreeSizer
from speculant.drafters.static_tree import BlockwiseDrafter, StaticTreeDrafter
from speculant.drafters.proposers import proposer_for
from speculant.eagle import EagleConfig, EagleDrafter, EagleModel
from speculant.heads import HeadsConfig, MedusaHeads, SequentialHeads
from speculant.training.losses import medusa_loss, row_inputs
from speculant.trees.buffers import build_tree

from helpers import pit_batched, uniformity
from tiny import tiny_llama

V, H = 6, 16
# repeated n-grams, so that the lookup branch finds continuations to propose
PROMPTS = [torch.tensor([1, 2, 3, 1, 2, 3, 1, 2]), torch.tensor([4, 0, 5, 4, 0, 5, 4, 0])]
# a pass cost under which the sizer picks trees of different sizes step by step (1 to 10 rows of
# each sequence) while 32 sequences share each pass: the sizer weighs a row against the whole pass
COST = PassCost((1, 8, 16, 32, 64), (10.0, 10.5, 11.5, 14.0, 20.0))
N = 100_000


def _distilled(target, medusa, hydra, eagle, steps: int = 200) -> None:
    """Train the heads for ``steps`` Adam steps on sequences the target samples itself, with the
    library's Medusa loss (``training.losses``: each head on the token it drafts, at every position),
    so that many of their drafts are accepted: the check then exercises accepted drafts as well as
    residual samples, in fewer passes for its tokens."""
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, V, (128, 4), generator=g)
    with torch.no_grad():
        for _ in range(48):
            p = target(ids).logits[:, -1].float().softmax(-1)
            ids = torch.cat([ids, torch.multinomial(p, 1, generator=g)], 1)
        hidden = target.model(ids).last_hidden_state  # (B, T, H): what the output layer reads
    mask = torch.ones_like(ids, dtype=torch.bool)  # every token is the target's own sample
    reads = torch.stack([row_inputs(row, hydra.num_heads) for row in ids])  # (B, T, K): tokens t+1..t+K, -1 past the end
    eagle.init_for_training(hidden.flatten(0, 1))
    lm = target.get_output_embeddings()
    logits = [(medusa, lambda: medusa(hidden)),  # head logits (K, B, T, V)
              (hydra, lambda: hydra(hidden, reads)),
              (eagle, lambda: lm(eagle(hidden, reads[..., 0].clamp(min=0)))[None])]  # right padding is harmless
    for heads, forward in logits:
        trained = [p for p in heads.parameters() if p.requires_grad]
        opt = torch.optim.Adam(trained, lr=3e-2)
        heads.train()
        for _ in range(steps):
            opt.zero_grad()
            medusa_loss(forward(), ids, mask, lam=1.0)[0].backward()
            opt.step()
        heads.eval()


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """The target and its distilled heads; distilled once per test run: the first test process
    to get here trains and saves them, under a lock, in the run's shared temporary directory, and
    the other loads them."""
    from speculant.runtime.process import file_lock

    target = tiny_llama(seed=4, vocab=V, hidden=H, layers=1, scale=60.0).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    lm, emb = target.get_output_embeddings(), target.get_input_embeddings()
    medusa = MedusaHeads(HeadsConfig(3, 1, H, V), lm)
    hydra = SequentialHeads(HeadsConfig(3, 1, H, V, kind="sequential"), lm, emb)
    eagle = EagleModel(EagleConfig.for_target(target.config, intermediate_size=32, depth=3), lm, emb)
    shared = tmp_path_factory.getbasetemp().parent  # one per run, seen by every xdist process
    saved = shared / "sampling-heads-distilled.pt"
    with file_lock(shared / "sampling-heads-distilled.lock"):
        if saved.is_file():
            for module, state in zip((medusa, hydra, eagle), torch.load(saved)):
                module.load_state_dict(state)
                module.eval()
        else:
            _distilled(target, medusa, hydra, eagle)
            torch.save([m.state_dict() for m in (medusa, hydra, eagle)], saved)
    return target, medusa, (hydra, eagle)


def _drafter(case: str, medusa, others):
    """A fresh drafter of the method ``case`` (one per sequence)."""
    hydra, eagle = others
    tree = build_tree("[[0],[1],[0,0],[1,0],[0,0,0]]")
    if case == "medusa+lookup":
        return StaticTreeDrafter(proposer_for(medusa, V), tree, V, lookup=LookupDrafter(2))
    if case == "hydra+lookup":
        return StaticTreeDrafter(proposer_for(hydra, V), tree, V, lookup=LookupDrafter(2))
    if case == "medusa-dynamic-sized":
        return DynamicTreeDrafter(proposer_for(medusa, V), DynamicTree(6, top_k=3), V, lookup=LookupDrafter(2),
                                  sizer=TreeSizer(COST, max_rows=10))
    if case == "hydra-dynamic-sized":
        return DynamicTreeDrafter(proposer_for(hydra, V), DynamicTree(6, top_k=3, beam=2), V, lookup=LookupDrafter(2),
                                  sizer=TreeSizer(COST, max_rows=10))
    if case == "eagle-dynamic-sized":
        return EagleDrafter(eagle, DynamicTree(6, top_k=3, beam=2), V, lookup=LookupDrafter(2),
                            sizer=TreeSizer(COST, max_rows=10))
    if case == "bpd":
        return BlockwiseDrafter(medusa, V, gamma=3)
    raise ValueError(case)


# the static trees carry a lookup branch (the heads' nodes and the chain's are accepted by one walk);
# the dynamic trees are sized step by step against DEAR and carry the lookup chain merged in
CASES = ["medusa+lookup", "hydra+lookup", "medusa-dynamic-sized", "hydra-dynamic-sized", "eagle-dynamic-sized", "bpd"]


@pytest.mark.slow  # 100,000 sampled tokens per method, 32 sequences per pass
@pytest.mark.statistical
@pytest.mark.parametrize("case", CASES)
def test_head_methods_sample_the_target_distribution(parts, case):
    target, medusa, others = parts
    made, sizes = [], set()

    def make(g):
        d = _drafter(case, medusa, others)
        made.append(d)
        if getattr(d, "sizer", None) is not None:  # every size chosen, step by step
            choose = d.sizer.choose
            d.sizer.choose = lambda *a, **k: sizes.add(choose(*a, **k)) or d.sizer.last_choice
        return d
    u = pit_batched(target, make, PROMPTS, N)
    pvalue, tv = uniformity(u)
    assert pvalue > 1e-4 and tv < 0.01, (pvalue, tv)
    drafters = [d for d in made if d.head_calls]
    assert sum(d.head_calls for d in drafters) > 1000  # the heads really drafted
    if case.endswith("sized"):  # ... trees of several sizes
        assert len(sizes) > 3, sizes


@pytest.mark.slow  # 10,000 sampled tokens per method (a test of its own: the statistical processes share them)
@pytest.mark.statistical
@pytest.mark.parametrize("case", CASES)
def test_head_methods_sampling_check_catches_typical_acceptance(parts, case):
    """Negative control of the test above: the same drafts under typical acceptance (approximate)
    must be caught."""
    target, medusa, others = parts
    bad_p, bad_tv = uniformity(pit_batched(target, lambda g: _drafter(case, medusa, others), PROMPTS, 10_000,
                                           acceptance=AcceptanceConfig("typical", eps=0.3)))
    assert bad_p < 1e-4, (bad_p, bad_tv)
