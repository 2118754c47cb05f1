"""Batched decoding (batching.py): several sequences per target pass give each sequence what it
gets decoded alone — the pass itself (forward_batch, bit for bit on the int4 kernels), greedy
output for every exact method on both backends, sequences of very different lengths, ending,
cancelled or joining mid-flight — and sampled sequences follow the target's distribution."""

from __future__ import annotations

import math

import pytest
import torch

from speculant import SpeculativeDecoder
from speculant.backends.base import ForwardRequest, HiddenNeed, forward_batch
from speculant.backends.hf import HFBackend
from speculant.backends.native import NativeBackend, NativeModel
from speculant.batching import Batch
from speculant.config import SamplingConfig
from speculant.tuning.costmodel import PassCost
from speculant.decoding import SequenceRun
from speculant.drafters.base import NoDrafter
from speculant.drafters.draft_model import DraftModelDrafter
from speculant.drafters.lookup import LookupDrafter
from speculant.heads import HeadsConfig, MedusaHeads, SequentialHeads, save_heads
from speculant.kernels import x86_kernels
from speculant.trees.buffers import build_tree, chain

from helpers import decode_to_end, pit_batched, uniformity as _uniformity
from tiny import perturbed, tiny_llama, tiny_model_dir, tiny_qwen2, word_tokenizer

V = 64
FLAT = PassCost((1, 64), (100.0, 100.0))  # no measuring in tests
GREEDY = SamplingConfig()
# a one-token prompt, a short one, a long repetitive one (the n-gram drafter finds a lot there)
PROMPTS = ["w5", "w1 w2 w3 w4 w1 w2 w3", " ".join(f"w{3 + i % 11}" for i in range(70))]
KERNELS = x86_kernels() is not None


def _randomized(heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return heads.eval()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    target = tiny_model_dir(root / "target", seed=0)
    draft = tiny_model_dir(root / "draft", seed=1, base=tiny_llama(0, scale=4.0), noise=0.3)
    lm = SpeculativeDecoder(str(target), method="ar", dtype="float32").target.model
    H = lm.config.hidden_size
    save_heads(_randomized(MedusaHeads(HeadsConfig(3, 1, H, V), lm.get_output_embeddings())), root / "medusa")
    save_heads(_randomized(SequentialHeads(HeadsConfig(3, 1, H, V, kind="sequential"), lm.get_output_embeddings(),
                                           lm.get_input_embeddings())), root / "hydra")
    return {"target": str(target), "draft": str(draft), "medusa": str(root / "medusa"), "hydra": str(root / "hydra")}


def _decoder(dirs, method, **options):
    draft = dirs["draft"] if method in ("sd", "mcsd") else None
    if method in ("medusa", "hydra", "bpd"):
        options.setdefault("heads", dirs["hydra" if method == "hydra" else "medusa"])
    return SpeculativeDecoder(dirs["target"], draft, method=method, dtype="float32", tree_budget=FLAT,
                              draft_quant="none", **options)


# ------------------------------------------------------------------ one pass

def _int4_model(seed=2):
    return NativeModel.from_hf(tiny_qwen2(seed=seed, scale=4.0, dtype=torch.bfloat16), "int4", quant_head=True,
                               keep_dense=False)


@pytest.mark.skipif(not KERNELS, reason="needs speculant's int4 kernel (row-invariant)")
@pytest.mark.parametrize("isa", ["", "portable"])  # "": the best this CPU has; portable: forced
def test_one_pass_gives_every_sequence_bit_for_bit_its_own_pass(isa, monkeypatch):
    """Three sequences after 3, 40 and 509 cached tokens in one pass — a 34-node tree, one token,
    a 20-token causal block with every hidden state — each get exactly what a pass of their own
    gives: logits, hidden states and the KV entries written."""
    if isa:
        if x86_kernels() is None:
            pytest.skip("needs speculant's x86 kernels")
        monkeypatch.setenv("SPECULANT_INT4_ISA", isa)
    model = _int4_model()
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(0, V, (n,), generator=g) for n in (3, 40, 509)]
    tree = build_tree("3x2x2x1")
    t0 = torch.randint(0, V, (tree.size,), generator=g)
    requests = [ForwardRequest(t0, 3 + tree.depths, tree.mask, want_hidden=HiddenNeed.LAST),
                ForwardRequest(torch.randint(0, V, (1,), generator=g)),
                ForwardRequest(torch.randint(0, V, (20,), generator=g), rows=torch.tensor([4, 19]),
                               want_hidden=HiddenNeed.ALL)]

    def primed():
        out = []
        for ctx in contexts:
            b = NativeBackend(model, capacity=1024)
            b.forward(ctx, rows=torch.empty(0, dtype=torch.long))
            out.append(b)
        return out
    together, alone = primed(), primed()
    outs = forward_batch(together, requests)
    for b_t, b_a, req, out, ctx in zip(together, alone, requests, outs, contexts):
        ref = b_a.forward(req.tokens, req.positions, req.tree_mask, req.rows, req.want_hidden)
        assert torch.equal(out.logits, ref.logits)
        assert (out.hidden is None) == (ref.hidden is None)
        if ref.hidden is not None:
            assert torch.equal(out.hidden, ref.hidden)
        n = ctx.shape[0] + req.tokens.shape[0]
        assert b_t.cache_length == b_a.cache_length == n
        assert torch.equal(b_t.cache.kv[:, :, :, :n], b_a.cache.kv[:, :, :, :n])


def test_forward_batch_refuses_a_shared_cache_and_falls_back_per_sequence():
    model = tiny_llama(0)
    hf = HFBackend(model)
    with pytest.raises(ValueError, match="one backend"):
        forward_batch([hf, hf], [ForwardRequest(torch.tensor([1])), ForwardRequest(torch.tensor([2]))])
    other = hf.sibling()
    assert other.model is hf.model and other.cache is not hf.cache
    a, b = forward_batch([hf, other], [ForwardRequest(torch.tensor([1, 2, 3])), ForwardRequest(torch.tensor([4]))])
    assert a.logits.shape == (3, V) and b.logits.shape == (1, V) and hf.cache_length == 3 and other.cache_length == 1


# ------------------------------------------------------------------ whole generations

@pytest.mark.parametrize("backend", ["hf", "native"])
@pytest.mark.parametrize("method, options", [
    ("ar", {}), ("sd", {"gamma": 3}), ("mcsd", {"tree": "2x2x1"}), ("lookup", {}),
    ("medusa", {}), ("hydra", {}), ("hydra", {"lookup_branch": 3}), ("bpd", {"gamma": 2})])
def test_batched_greedy_equals_each_sequence_alone(dirs, backend, method, options):
    dec = _decoder(dirs, method, backend=backend, **options)
    alone = [dec.generate(p, 24).token_ids for p in PROMPTS]
    assert [r.token_ids for r in dec.generate(PROMPTS, 24)] == alone  # all three together
    assert [r.token_ids for r in dec.generate_batch(PROMPTS, 24, max_batch=2)] == alone  # the third joins later


@pytest.mark.skipif(not KERNELS, reason="needs speculant's int4 kernel (row-invariant)")
def test_batched_int4_bf16_is_bit_identical_to_alone(tmp_path):
    """The default precision (bf16 activations, int4 weights, speculant's row-invariant kernels):
    batched speculative output equals each sequence's plain output alone, token for token."""
    model = tiny_qwen2(seed=0, scale=4.0)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(tmp_path / "q")
    word_tokenizer(V).save_pretrained(tmp_path / "q")
    heads = tmp_path / "heads"
    save_heads(_randomized(MedusaHeads(HeadsConfig(3, 1, 64, V), model.get_output_embeddings())), heads)
    kw = dict(backend="native", dtype="bfloat16", target_quant="int4", tree_budget=FLAT)
    plain = SpeculativeDecoder(str(tmp_path / "q"), method="ar", **kw)
    prompts = [[int(t) for t in p] for p in _id_prompts()]  # token ids: this tiny Qwen2 has no text tokenizer
    want = [plain.generate(p, 30).token_ids for p in prompts]
    for method, extra in (("ar", {}), ("lookup", {}), ("medusa", {"heads": str(heads)})):
        dec = SpeculativeDecoder(str(tmp_path / "q"), method=method, **kw, **extra)
        assert [r.token_ids for r in dec.generate(prompts, 30)] == want, method


def _id_prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.tensor([7]), torch.randint(3, V, (8,), generator=g), torch.randint(3, 14, (70,), generator=g)]


def _runs(target_backend, drafter_of, prompts, lengths):
    return [SequenceRun(target_backend.sibling(), drafter_of(), p, max_new_tokens=n, sampling=GREEDY)
            for p, n in zip(prompts, lengths)]


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_sequences_end_leave_and_join_mid_flight(kind):
    """One sequence ends after 3 tokens, one is cancelled after 2 steps, one joins after 3 steps,
    the rest go on: each one's tokens are what it gets alone (the cancelled one's a prefix)."""
    target, draft = tiny_llama(0, scale=4.0), perturbed(tiny_llama(0, scale=4.0), noise=0.3)
    make = NativeBackend if kind == "native" else HFBackend
    tb, db = make(target), make(draft)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (1, 5, 40, 12)]
    lengths = [3, 30, 30, 25]

    def drafter():
        return DraftModelDrafter(db.sibling(), chain(3), GREEDY, V)
    want = [decode_to_end(tb, drafter(), p, n).generated for p, n in zip(prompts, lengths)]
    runs = _runs(tb, drafter, prompts, lengths)
    batch = Batch()
    for i in range(3):
        batch.add(i, runs[i])
    steps = 0
    while len(batch):
        batch.step()
        steps += 1
        if steps == 2:
            assert batch.remove(1) is not None  # cancelled
        if steps == 3:
            batch.add(3, runs[3])  # joins
    assert runs[0].state.generated == want[0] and len(want[0]) == 3
    got1 = runs[1].state.generated
    assert 0 < len(got1) < 30 and got1 == want[1][:len(got1)]
    assert runs[2].state.generated == want[2]
    assert runs[3].state.generated == want[3]
    batch.add(8, SequenceRun(runs[2].target, NoDrafter(), prompts[0], max_new_tokens=2, sampling=GREEDY))
    with pytest.raises(ValueError, match="its own target backend"):
        batch.add(9, SequenceRun(runs[2].target, NoDrafter(), prompts[0], max_new_tokens=2, sampling=GREEDY))


def test_a_fault_in_one_sequence_ends_it_alone():
    target = tiny_llama(0, scale=4.0)
    tb = NativeBackend(target)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (6,), generator=g) for _ in range(3)]
    want = [decode_to_end(tb, LookupDrafter(3), p, 15).generated for p in prompts]
    runs = _runs(tb, lambda: LookupDrafter(3), prompts, [15] * 3)
    failed = []

    class Broken(LookupDrafter):
        def propose(self, context):
            if context.shape[0] > 9:
                raise RuntimeError("injected fault")
            return super().propose(context)
    runs[1].drafter = Broken(3)
    batch = Batch()
    for i, r in enumerate(runs):
        batch.add(i, r, on_error=lambda m, e: failed.append((m.key, str(e))))
    while len(batch):
        batch.step()
    assert failed == [(1, "injected fault")]
    assert runs[0].state.generated == want[0] and runs[2].state.generated == want[2]


def _big_heads(kind: str, V_big: int = 2048, H: int = 64):
    """Heads over a 2048-token vocabulary: large enough for the int4 shortlist (``coarse_ranker``)."""
    g = torch.Generator().manual_seed(3)
    lm = torch.nn.Linear(H, V_big, bias=False)
    emb = torch.nn.Embedding(V_big, H)
    with torch.no_grad():
        lm.weight.copy_(torch.randn(V_big, H, generator=g))
        emb.weight.copy_(torch.randn(V_big, H, generator=g))
    if kind == "medusa":
        return _randomized(MedusaHeads(HeadsConfig(3, 1, H, V_big), lm))
    return _randomized(SequentialHeads(HeadsConfig(3, 1, H, V_big, kind="sequential"), lm, emb))


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_heads_drafts_of_several_sequences_in_one_call(kind):
    """The heads' work of several sequences (``HeadsCandidates`` / ``HeadsStep`` jobs) runs as one
    call over all their states and gives each what it gets alone; the draft trees of a batch's
    members are then what each drafter proposes alone."""
    from speculant.drafters.dynamic_tree import DynamicTree, DynamicTreeDrafter
    from speculant.drafters.head_steps import HeadsCandidates, HeadsStep, IndependentHeads
    from speculant.drafters.proposers import proposer_for
    heads, H, Vb = _big_heads(kind), 64, 2048
    g = torch.Generator().manual_seed(4)
    states = torch.randn(3, H, generator=g)
    if kind == "medusa":
        ev = IndependentHeads(heads, Vb)
        jobs = [HeadsCandidates(ev, s, 5, 3) for s in states]
        alone = [ev.candidates_logprobs(s, 5, 3) for s in states]
    else:
        tokens = torch.randint(0, Vb, (3,), generator=g)
        jobs = [HeadsStep(heads, states[:1], tokens[:1], 5, Vb), HeadsStep(heads, states[1:], tokens[1:], 5, Vb)]
        alone = [(st, *heads.draft_topk(st, 5, Vb, logprobs=True))
                 for st in (heads.step(states[:1], tokens[:1]), heads.step(states[1:], tokens[1:]))]
    assert len({j.together for j in jobs}) == 1
    together = type(jobs[0]).run_together(jobs)
    for got, want in zip(together, alone):
        assert [t.shape for t in got] == [t.shape for t in want]
        for a, b in zip(got, want):
            if a.dtype == torch.long:
                assert torch.equal(a, b)
            else:
                assert torch.allclose(a.float(), b.float(), atol=1e-3, rtol=1e-3)
    # members' drafters in a batch: one call of the heads per depth for all of them
    drafters = [DynamicTreeDrafter(proposer_for(heads, Vb), DynamicTree(8), Vb) for _ in range(3)]
    for d, s in zip(drafters, states):
        d.begin(torch.tensor([1, 2]), hidden=s)
    contexts = [torch.tensor([1, 2, 5 + i]) for i in range(3)]
    want = [d.propose(c) for d, c in zip(drafters, contexts)]
    calls = []
    run_together = type(jobs[0]).run_together

    def counted(js):
        calls.append(len(js))
        return run_together(js)
    from speculant import batching
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(jobs[0]), "run_together", staticmethod(counted))
        drafts, errors = batching._run_plans({i: d.propose_passes(c) for i, (d, c) in enumerate(zip(drafters, contexts))})
    assert not errors and calls == [3] * (1 if kind == "medusa" else heads.num_heads)
    for i, w in enumerate(want):
        assert torch.equal(drafts[i].tokens, w.tokens) and drafts[i].tree.paths == w.tree.paths


def test_the_batch_paces_its_members_together(dirs):
    """While several members step together the batch's pacer chooses for all of them (a step it
    keeps plain verifies every member's root alone, and the members' own pacers do not count
    it); a member alone follows its own pacer."""
    from speculant.tuning.pacing import Pacer

    class Plain(Pacer):
        def draft_now(self):
            return False
    dec = _decoder(dirs, "hydra", backend="native")
    alone = [dec.generate(p, 16).token_ids for p in PROMPTS]
    dec.batch_pacer = Plain()
    got = dec.generate_batch(PROMPTS, 16)
    assert [r.token_ids for r in got] == alone
    for r in got:  # no member drafted a token (the one-token prompt's first step runs while the others
        assert max(r.stats.drafted_per_call) == 0  # prefill: alone, by its own pacer, with nothing to draft from)
        assert r.stats.plain_steps >= r.stats.target_calls - 1
    batch = Batch(pacer=Plain())
    gen = dec.start(PROMPTS[2], 16)
    member = dec.join(batch, gen)
    with torch.inference_mode():
        while len(batch):
            batch.step()
    assert member.run.state.stats.plain_steps < member.run.state.stats.target_calls  # alone: its own pacer drafts
    assert batch.pacer.steps == {True: 0, False: 0}


def test_batch_sizing_shares_the_pass():
    """With other sequences in the pass, a sizer sizes for the whole pass: where each extra row
    costs about a row's time, more sequences mean a smaller tree each (never below the root)."""
    from speculant.tuning.sizing import TreeSizer
    cost = PassCost((1, 8, 32), (10.0, 40.0, 130.0))
    scores = [-0.1 * i for i in range(12)]
    alone = TreeSizer(cost, max_rows=32)
    m_alone, _ = alone.choose(scores, [], 0)
    tokens = 1 + sum(math.exp(s) for s in scores[:m_alone])  # what such a tree yields
    chosen = []
    for others in (1, 3, 7):  # each other sequence verifies the same tree and expects as much from it
        shared = alone.fork()
        shared.share(rows=others * (1 + m_alone), tokens=others * tokens)
        chosen.append(shared.choose(scores, [], 0)[0])
    assert chosen == sorted(chosen, reverse=True) and chosen[-1] < m_alone and min(chosen) >= 0, chosen
    assert alone.others_rows == 0  # fork: a sizer of its own


# ------------------------------------------------------------------ sampling
# (the probability integral transform of every emitted token: helpers.pit_batched)

VS = 6
S_PROMPTS = [torch.tensor([1, 2, 3, 1, 2]), torch.tensor([4, 0, 5, 4, 0])]


def _pit_batched(target, draft, tokens: int, temperature: float = 1.0):
    """``tokens`` PIT values of mcsd generations (a 2x2 tree of sampled draft tokens), 32 per pass."""
    db = NativeBackend(draft)
    sampling = SamplingConfig(temperature=temperature)
    return pit_batched(target, lambda g: DraftModelDrafter(db.sibling(), build_tree("2x2"), sampling, VS, generator=g),
                       S_PROMPTS, tokens, temperature=temperature)


def _sampling_pair():
    target = tiny_llama(seed=4, vocab=VS, hidden=16, layers=1, scale=60.0)
    return target, perturbed(target, noise=1.5, seed=5)


@pytest.mark.slow  # 100,000 sampled tokens, 32 sequences per pass
@pytest.mark.statistical
def test_batched_sampling_follows_the_target_distribution():
    u = _pit_batched(*_sampling_pair(), 100_000)
    pvalue, tv = _uniformity(u)
    assert pvalue > 1e-4 and tv < 0.01, (pvalue, tv)


@pytest.mark.slow  # 10,000 sampled tokens (a test of its own: the two statistical processes share the work)
@pytest.mark.statistical
def test_batched_sampling_check_catches_a_wrong_distribution():
    """The negative controls of the test above, each must fail its uniformity check: tokens sampled
    at another temperature than the one the PIT is computed for, and a slightly skewed uniform sample."""
    bad_p, bad_tv = _uniformity(_pit_batched(*_sampling_pair(), 10_000, temperature=0.8))
    assert bad_p < 1e-4, (bad_p, bad_tv)
    g = torch.Generator().manual_seed(3)
    assert _uniformity(torch.rand(20_000, generator=g) ** 1.1)[0] < 1e-4
