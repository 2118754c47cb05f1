"""Medusa and blockwise (BPD) drafters: tree filling from the heads' top-k lists, and end to end on
a tiny random Llama — greedy output identical to plain greedy, with random and trained heads.

The loop hands the target's hidden state of the last accepted node to ``HiddenNeed.LAST`` drafters, so
one target call per step both verifies and feeds the heads. Approximate acceptance (typical, top-k,
distance, minimum block) is checked end to end too: it reduces to greedy where it should, and
top-k keeps every token in the target's top-k."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from speculant.backends.hf import HFBackend
from speculant.config import SamplingConfig, parse_acceptance
from speculant.decoding import decode
from speculant.drafters.base import HiddenNeed, NoDrafter, ProposesAlone
from speculant.drafters.medusa import BlockwiseDrafter, MedusaDrafter
from speculant.errors import ConfigError
from speculant.heads import HeadsConfig, MedusaHeads
from speculant.trees.buffers import build_tree, chain

from helpers import decode_to_end
from tiny import tiny_llama, fixed_prompts

V, H, K = 64, 48, 3
GREEDY = SamplingConfig()
TREES = ["[[0],[1],[0,0],[0,1]]", "3", "3x2x1", "[[0],[1],[2],[0,0],[1,0],[0,0,0]]"]


class FakeHeads:
    """Head k ranks token 10*(k+1) + r at rank r (r < 5), everything else below."""
    num_heads = K

    def __call__(self, hidden):
        logits = torch.full((K, V), -100.0)
        for k in range(K):
            logits[k, 10 * (k + 1): 10 * (k + 1) + 5] = -torch.arange(5.0)
        return logits


class PathLog(ProposesAlone):
    """Drafter proxy recording each accepted path as ranks (the loop hands it hidden states)."""
    hidden_need = HiddenNeed.LAST
    hidden_layers = ()

    def __init__(self, drafter):
        self.drafter, self.paths = drafter, []

    def begin(self, prompt, hidden=None):
        self.drafter.begin(prompt, hidden=hidden)

    def propose(self, context):
        return self.drafter.propose(context)

    def observe(self, path, next_token, hidden=None):
        self.paths.append([int(self.drafter.tree.ranks[i]) for i in path[1:]])
        self.drafter.observe(path, next_token, hidden=hidden)


def prompts():
    return fixed_prompts(V)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, vocab=V, hidden=H, scale=4.0)


@pytest.fixture(scope="module")
def plain(target):
    return [decode_to_end(target, NoDrafter(), p).generated for p in prompts()]


@pytest.fixture(scope="module")
def random_heads(target):
    heads = MedusaHeads(HeadsConfig(K, 1, H, V, shared_lm_head=False))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return heads.eval()


def fit_heads(target, plain, steps):
    """Heads fitted for ``steps`` steps to the target's own greedy continuations (Medusa-1
    self-distillation in miniature): head k learns token t+k+2 from the hidden state at t."""
    torch.manual_seed(0)
    heads = MedusaHeads(HeadsConfig(K, 1, H, V, shared_lm_head=False), target.get_output_embeddings())
    seqs = [torch.cat([p, torch.tensor(g)]) for p, g in zip(prompts(), plain)]
    with torch.no_grad():
        hidden = [target.get_decoder()(input_ids=s.view(1, -1)).last_hidden_state[0] for s in seqs]  # (T, H)
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = 0.0
        for s, h in zip(seqs, hidden):
            logits = heads(h)  # (K, T, V)
            for k in range(K):
                if s.shape[0] > k + 2:
                    loss = loss + F.cross_entropy(logits[k, : s.shape[0] - k - 2], s[k + 2:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval()


@pytest.fixture(scope="module")
def trained_heads(target, plain):
    return fit_heads(target, plain, 150)  # nearly an oracle on these prompts


@pytest.fixture(scope="module")
def partial_heads(target, plain):
    return fit_heads(target, plain, 10)  # right some of the time, often not at rank 0


def test_tree_filled_from_head_ranks():
    drafter = MedusaDrafter(FakeHeads(), build_tree("[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]"), V)
    ctx = torch.tensor([7, 8, 9])
    first = drafter.propose(ctx)  # no hidden state yet: the root alone
    assert first.tree.size == 1 and first.tokens.tolist() == [9] and first.q is None
    drafter.observe([0], 4, hidden=torch.zeros(H))
    draft = drafter.propose(torch.tensor([7, 8, 9, 4]))
    # depth d holds head d-1's candidates, shared by every parent (Cartesian-product tree)
    assert draft.tokens.tolist() == [4, 10, 11, 20, 21, 20, 30]
    drafter.observe([0, 1], 5, hidden=None)  # no hidden state -> plain step
    assert drafter.propose(torch.tensor([4, 10, 5])).tree.size == 1
    drafter.begin(torch.tensor([1, 2]), hidden=torch.zeros(H))  # a prefill hidden state drafts at once
    assert drafter.propose(torch.tensor([1, 2])).tokens.tolist() == [2, 10, 11, 20, 21, 20, 30]


def test_blockwise_chain_of_argmaxes():
    drafter = BlockwiseDrafter(FakeHeads(), V)
    assert drafter.tree.paths == chain(K).paths
    drafter.observe([0], 4, hidden=torch.zeros(H))
    assert drafter.propose(torch.tensor([4])).tokens.tolist() == [4, 10, 20, 30]
    assert BlockwiseDrafter(FakeHeads(), V, gamma=2).tree.depth == 2


def test_bad_configurations():
    with pytest.raises(ConfigError, match="depth 4 but there are only 3 heads"):
        MedusaDrafter(FakeHeads(), build_tree("2x1x1x1"), V)
    with pytest.raises(ConfigError, match="gamma=4"):
        BlockwiseDrafter(FakeHeads(), V, gamma=4)
    with pytest.raises(ConfigError, match=">= 1"):
        BlockwiseDrafter(FakeHeads(), V, gamma=0)
    with pytest.raises(ConfigError, match="vocabulary"):
        MedusaDrafter(FakeHeads(), build_tree("5x1"), 4)  # rank 4 of a 4-token vocabulary
    with pytest.raises(ValueError, match="hidden"):
        MedusaDrafter(FakeHeads(), chain(1), V).observe([0], 1, hidden=torch.zeros(2, H))


def test_medusa_drafter_picks_the_tree_policy():
    """A static tree gets the static-tree drafter, a dynamic one the dynamic-tree drafter."""
    from speculant.drafters.dynamic_tree import DynamicTree, DynamicTreeDrafter
    from speculant.drafters.static_tree import StaticTreeDrafter
    static = MedusaDrafter(FakeHeads(), build_tree("2x1"), V)
    dynamic = MedusaDrafter(FakeHeads(), build_tree("2x1"), V, dynamic=DynamicTree(nodes=4, top_k=2))
    assert isinstance(static, StaticTreeDrafter) and static.tree.size == build_tree("2x1").size
    assert isinstance(dynamic, DynamicTreeDrafter) and dynamic.depth == K


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("which", ["random_heads", "partial_heads", "trained_heads"])
def test_medusa_greedy_identical(request, target, plain, tree, which):
    heads = request.getfixturevalue(which)
    for prompt, ref in zip(prompts(), plain):
        drafter = MedusaDrafter(heads, build_tree(tree), V)
        state = decode_to_end(target, drafter, prompt)
        assert state.generated == ref
        # every step drafts; the first one from the prefill's hidden state (none for a 1-token prompt)
        assert drafter.head_calls == state.stats.target_calls - (prompt.shape[0] == 1)
        if which != "random_heads":
            assert sum(state.stats.accepted_per_call) > 0
            assert state.stats.target_calls < len(ref)


def test_side_branches_and_partial_paths_accepted(target, plain, partial_heads):
    """Partly trained heads exercise what oracle heads do not: accepting a rank > 0 branch (its KV
    compacted into place) and stopping inside the tree; the output still equals plain greedy."""
    paths = []
    for prompt, ref in zip(prompts(), plain):
        log = PathLog(MedusaDrafter(partial_heads, build_tree("3x2x1"), V))
        state = decode_to_end(target, log, prompt)
        assert state.generated == ref
        paths += log.paths
    assert any(any(r > 0 for r in p) for p in paths)  # a side branch was accepted
    assert any(len(p) < 3 for p in paths)  # a step stopped inside the tree
    assert any(len(p) == 3 for p in paths)  # and one accepted a whole path (bonus token)


@pytest.mark.parametrize("gamma", [1, 3])
def test_blockwise_greedy_identical(target, plain, trained_heads, gamma):
    calls = 0
    for prompt, ref in zip(prompts(), plain):
        state = decode_to_end(target, BlockwiseDrafter(trained_heads, V, gamma), prompt)
        assert state.generated == ref
        calls += state.stats.target_calls
    assert calls < sum(len(r) for r in plain)


def test_trained_heads_cut_target_calls(target, plain, trained_heads):
    state = decode_to_end(target, MedusaDrafter(trained_heads, build_tree("3x2x1"), V), prompts()[0])
    assert state.stats.tokens_per_call > 1.5, state.stats.to_dict()


@pytest.mark.parametrize("at", [0, 3, 9])
def test_eos_inside_accepted_block(target, plain, trained_heads, at):
    free = plain[0][:20]
    eos = free[at]
    state = decode_to_end(target, MedusaDrafter(trained_heads, build_tree("3x2x1"), V), prompts()[0], n=20, eos={eos})
    assert state.generated == free[:free.index(eos) + 1]
    assert state.finish_reason == "eos"


def test_sampling_runs(target, trained_heads):
    """Deterministic proposals under sampling (q is None): the loop's exact rule applies."""
    sampling = SamplingConfig(temperature=0.8, seed=1)
    state = decode_to_end(target, MedusaDrafter(trained_heads, build_tree("3x2x1"), V), prompts()[0], n=25,
                sampling=sampling, generator=torch.Generator().manual_seed(1))
    assert len(state.generated) == 25


def test_one_target_call_per_step_and_prefill_hands_over_hidden(target, plain, trained_heads):
    drafter = MedusaDrafter(trained_heads, build_tree("3x2x1"), V)
    state = decode_to_end(target, drafter, prompts()[0])
    assert state.generated == plain[0]
    assert drafter.head_calls == state.stats.target_calls  # the prefill's hidden state drafts step 1 too


# ------------------------------------------------------------------ approximate acceptance in the loop

def target_ranks(target, prompt, generated):
    """Rank of each generated token under the target's own logits at its position (teacher forcing)."""
    seq = torch.cat([prompt, torch.tensor(generated)])
    with torch.no_grad():
        logits = target(seq.view(1, -1)).logits[0, prompt.shape[0] - 1: -1]  # (n, V)
    order = logits.sort(dim=-1, descending=True, stable=True).indices
    return [int((order[i] == t).nonzero()) for i, t in enumerate(generated)]


@pytest.mark.parametrize("rule", ["typical", "topk=1", "dist=0"])
def test_approximate_rules_reduce_to_greedy(target, plain, partial_heads, rule):
    """Typical acceptance at temperature 0, top-1 and distance 0 accept exactly the argmax."""
    acc = parse_acceptance(rule)
    for prompt, ref in zip(prompts(), plain):
        for drafter in (MedusaDrafter(partial_heads, build_tree("3x2x1"), V), BlockwiseDrafter(partial_heads, V)):
            emb = target.get_input_embeddings().weight if acc.rule == "distance" else None
            state = None
            for state, _ in decode(HFBackend(target), drafter, prompt, max_new_tokens=40, sampling=GREEDY,
                                   acceptance=acc, embedding=emb):
                pass
            assert state.generated == ref
            assert state.stats.to_dict()["acceptance"] == acc.label and not state.stats.to_dict()["lossless"]


def test_topk_acceptance_keeps_every_token_in_the_targets_topk(target, plain, partial_heads):
    exact_calls = approx_calls = 0
    for prompt, ref in zip(prompts(), plain):
        exact = decode_to_end(target, MedusaDrafter(partial_heads, build_tree("3x2x1"), V), prompt)
        approx = decode_to_end(target, MedusaDrafter(partial_heads, build_tree("3x2x1"), V), prompt,
                     acceptance=parse_acceptance("topk=3"))
        assert len(approx.generated) == 40
        assert max(target_ranks(target, prompt, approx.generated)) < 3
        exact_calls += exact.stats.target_calls
        approx_calls += approx.stats.target_calls
    assert approx_calls < exact_calls  # looser rule, more tokens per call


def test_min_block_forces_the_first_tokens(target, partial_heads):
    state = decode_to_end(target, BlockwiseDrafter(partial_heads, V, 3), prompts()[0], n=30,
                acceptance=parse_acceptance("min=2"))
    assert all(a >= 2 for a in state.stats.accepted_per_call[1:-1])  # step 1 has no hidden state yet
    assert state.stats.acceptance == "exact+min2"


def repetitive_prompts():
    """Prompts that repeat a phrase, so the prompt-lookup branch finds n-gram matches."""
    return [torch.tensor([5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]), *prompts()[:2]]


@pytest.mark.parametrize("which", ["random_heads", "partial_heads"])
def test_lookup_branch_greedy_identical(target, which, request):
    """A prompt-lookup chain beside the heads' tree: output identical to plain greedy, and the
    branch's nodes are unfilled (-1) where there is no match."""
    from speculant.drafters.lookup import LookupDrafter
    heads = request.getfixturevalue(which)
    for prompt in repetitive_prompts():
        ref = decode_to_end(target, NoDrafter(), prompt).generated
        drafter = MedusaDrafter(heads, build_tree("3x2x1"), V, LookupDrafter(4))
        assert drafter.tree.size == build_tree("3x2x1").size + 4 and drafter.depth == 3
        assert decode_to_end(target, drafter, prompt).generated == ref


def test_lookup_branch_is_filled_and_accepted():
    from speculant.drafters.lookup import LookupDrafter
    drafter = MedusaDrafter(FakeHeads(), build_tree("[[0],[1],[0,0]]"), V, LookupDrafter(3))
    drafter.observe([0], 4, hidden=torch.zeros(H))
    ctx = torch.tensor([1, 2, 3, 50, 51, 3])  # "3" occurred before, followed by 50, 51, 3
    d = drafter.propose(ctx)
    paths = {p: int(d.tokens[i]) for i, p in enumerate(d.tree.paths)}
    assert paths == {(): 3, (0,): 10, (1,): 11, (2,): 50, (0, 0): 20, (2, 0): 51, (2, 0, 0): 3}
    d = drafter.propose(torch.tensor([1, 2, 60]))  # no match: the branch is unfilled
    assert [int(d.tokens[d.tree.paths.index(p)]) for p in [(2,), (2, 0), (2, 0, 0)]] == [-1, -1, -1]


def test_greedy_walk_takes_the_deepest_of_equal_siblings():
    """Two siblings carry the same token: the walk follows the one whose subtree accepts more."""
    from speculant.acceptance import accept_tree
    from speculant.trees.draft import Draft
    tree = build_tree("[[0],[1],[1,0]]")  # nodes: root, (0,), (1,), (1,0)
    tokens = torch.tensor([1, 7, 7, 9])
    logits = torch.full((4, V), -5.0)
    logits[0, 7] = logits[1, 3] = logits[2, 9] = logits[3, 4] = 5.0
    path, nxt = accept_tree(Draft(tree, tokens), logits, GREEDY)
    assert path == [0, 2, 3] and nxt == 4


# ------------------------------------------------------------------ sequential (token-conditioned) heads

def fit_sequential(target, plain, steps, seed=0):
    """Sequential heads fitted for ``steps`` steps to the target's greedy continuations: from the
    hidden state at t and the tokens t+1 .. t+d, depth d learns token t+d+1."""
    from speculant.heads import SequentialHeads
    torch.manual_seed(seed)
    heads = SequentialHeads(HeadsConfig(K, 1, H, V, kind="sequential"), target.get_output_embeddings(),
                            target.get_input_embeddings())
    with torch.no_grad():  # a random start, so that even unfitted heads make non-trivial trees
        for p in [*heads.blocks.parameters(), heads.fc.weight]:
            p.add_(0.1 * torch.randn(p.shape))
    seqs = [torch.cat([p, torch.tensor(g)]) for p, g in zip(prompts(), plain)]
    with torch.no_grad():
        hidden = [target.get_decoder()(input_ids=s.view(1, -1)).last_hidden_state[0] for s in seqs]
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = 0.0
        for s, h in zip(seqs, hidden):
            n = s.shape[0] - K - 1  # positions with all K + 1 following tokens
            if n < 1:
                continue
            idx = torch.arange(n)[:, None] + torch.arange(1, K + 2)[None]  # (n, K+1): tokens t+1 .. t+K+1
            logits = heads(h[:n], s[idx[:, :K]])  # (K, n, V)
            loss = loss + F.cross_entropy(logits.reshape(-1, V), s[idx[:, 1:]].T.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval()


@pytest.fixture(scope="module")
def seq_heads_random(target, plain):
    return fit_sequential(target, plain, 0)


@pytest.fixture(scope="module")
def seq_heads_trained(target, plain):
    return fit_sequential(target, plain, 100)


@pytest.fixture(scope="module")
def seq_heads_small_vocab(target, seq_heads_trained):
    """Trained sequential heads that may only propose the 24 tokens of lowest id."""
    import dataclasses
    from speculant.heads import SequentialHeads
    trained = seq_heads_trained
    cfg = dataclasses.replace(trained.config, draft_vocab=24)
    heads = SequentialHeads(cfg, target.get_output_embeddings(), target.get_input_embeddings())
    heads.load_state_dict({**trained.state_dict(), "draft_vocab": torch.arange(24)})
    return heads.eval()


@pytest.fixture(scope="module")
def seq_heads_context(target, seq_heads_trained):
    """The trained sequential heads behind a random (not identity) context layer."""
    import dataclasses
    from speculant.heads import SequentialHeads
    trained = seq_heads_trained
    heads = SequentialHeads(dataclasses.replace(trained.config, context_size=32), target.get_output_embeddings(),
                            target.get_input_embeddings())
    heads.load_state_dict(trained.state_dict(), strict=False)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in heads.context.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.05 * torch.randn(p.shape, generator=g))
    return heads.eval()


@pytest.mark.slow
def test_context_layer_reads_every_committed_position(target, plain, seq_heads_context):
    """With a context layer the loop hands the drafter the prefill's and every accepted node's
    hidden states, in order: the heads' first state after decoding equals the layer's output over
    the target's hidden states of all committed tokens, computed in one pass."""
    heads, checked = seq_heads_context, 0
    for prompt, ref in zip(prompts(), plain):
        drafter = MedusaDrafter(heads, build_tree("3x2x1"), V)
        assert drafter.hidden_need is HiddenNeed.ALL
        state = decode_to_end(target, drafter, prompt)
        assert state.generated == ref
        L = drafter.proposer.source.context_cache.length
        if L > state.context.shape[0]:  # the last block was cut at max_new_tokens: its tail is unknown here
            continue
        with torch.no_grad():
            hidden = target.get_decoder()(input_ids=state.context[:L].view(1, -1)).last_hidden_state
            want = heads.context(hidden.to(heads.dtype))[0, -1]
        torch.testing.assert_close(drafter.proposer.state, want, atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked >= 2


def test_sequential_tree_children_follow_their_own_path(target, seq_heads_random):
    """Every node holds the rank-r token of the heads' step along ITS path: recomputed here node by
    node from the hidden state, the root and the path's tokens."""
    heads, tree = seq_heads_random, build_tree("[[0],[1],[2],[0,0],[0,1],[1,0],[2,0],[0,0,0],[1,0,0]]")
    drafter = MedusaDrafter(heads, tree, V)
    hidden = torch.randn(H)
    drafter.observe([0], 5, hidden=hidden)
    d = drafter.propose(torch.tensor([3, 5]))
    assert d.tokens[0] == 5 and d.tree is tree
    with torch.no_grad():
        for i, path in enumerate(tree.paths[1:], start=1):
            state = heads.step(hidden[None], torch.tensor([5]))
            node = 0
            for r in path[:-1]:
                node = int(tree.children[node, r])
                state = heads.step(state, d.tokens[node].view(1))
            order = heads.project(state)[0].topk(path[-1] + 1).indices
            assert int(d.tokens[i]) == int(order[path[-1]]), path
        # children really depend on the parent: the depth-1 siblings get different ranked child lists
        root = heads.step(hidden[None], torch.tensor([5]))
        kids = {tuple(heads.project(heads.step(root, d.tokens[n].view(1)))[0].topk(3).indices.tolist()) for n in (1, 2, 3)}
    assert len(kids) > 1


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("which", ["seq_heads_random", "seq_heads_trained", "seq_heads_small_vocab",
                                   "seq_heads_context"])
def test_sequential_greedy_identical(request, target, plain, tree, which):
    heads = request.getfixturevalue(which)
    calls = 0
    for prompt, ref in zip(prompts(), plain):
        drafter = MedusaDrafter(heads, build_tree(tree), V)
        state = PathLog(drafter) if which == "seq_heads_small_vocab" else drafter
        state = decode_to_end(target, state, prompt)
        assert state.generated == ref
        calls += state.stats.target_calls
        if which == "seq_heads_small_vocab":  # only draft-vocabulary tokens are ever proposed
            d = drafter.propose(torch.cat([prompt, torch.tensor(ref)]))
            assert all(int(t) < 24 for t in d.tokens[1:])
    if which == "seq_heads_trained":
        assert calls < 0.6 * sum(len(r) for r in plain)


def test_sequential_blockwise_and_lookup_branch_identical(target, plain, seq_heads_trained):
    from speculant.drafters.lookup import LookupDrafter
    for prompt, ref in zip(prompts(), plain):
        assert decode_to_end(target, BlockwiseDrafter(seq_heads_trained, V, 3), prompt).generated == ref
        drafter = MedusaDrafter(seq_heads_trained, build_tree("3x2x1"), V, LookupDrafter(3))
        assert decode_to_end(target, drafter, prompt).generated == ref


# ------------------------------------------------------------------ dynamic trees (EAGLE-2 style)

DYNAMIC = ["dynamic:1", "dynamic:6:2", "dynamic:10"]


@pytest.mark.parametrize("spec", DYNAMIC)
@pytest.mark.parametrize("which", ["seq_heads_random", "seq_heads_trained", "seq_heads_small_vocab",
                                   "seq_heads_context"])
def test_dynamic_tree_greedy_identical(request, target, plain, spec, which):
    from speculant.drafters.lookup import LookupDrafter
    from speculant.drafters.medusa import DynamicTree
    heads = request.getfixturevalue(which)
    calls = 0
    for prompt, ref in zip(prompts(), plain):
        for lookup in (None, LookupDrafter(3)):
            state = decode_to_end(target, MedusaDrafter(heads, build_tree("2"), V, lookup, dynamic=DynamicTree.parse(spec)), prompt)
            assert state.generated == ref
            calls += state.stats.target_calls if lookup is None else 0
    if which == "seq_heads_trained" and spec == "dynamic:10":
        assert calls < 0.6 * sum(len(r) for r in plain)


def test_dynamic_tree_keeps_the_best_scored_nodes(target, seq_heads_random):
    """grow() against a brute-force re-derivation: every node holds the rank-r token of the heads'
    step along its own path; the chosen set is closed under ancestors; and no expanded candidate
    left out scores above a chosen node."""
    from speculant.drafters.medusa import DynamicTree
    heads = seq_heads_random
    cfg = DynamicTree(nodes=7, depth=3, top_k=3, beam=2)
    drafter = MedusaDrafter(heads, build_tree("2"), V, dynamic=cfg)
    hidden, root = torch.randn(H), torch.tensor([5])
    paths, tokens = drafter.grow(hidden, root)
    assert len(paths) == 7 and len(set(paths)) == 7
    chosen = dict(zip(paths, tokens.tolist()))
    with torch.no_grad():
        def state_of(path):  # the heads' state after the root and the path's tokens
            s = heads.step(hidden[None], root)
            for d in range(1, len(path) + 1):
                s = heads.step(s, torch.tensor([chosen_or_all[path[:d]]]))
            return s

        # every candidate the procedure looked at: children of the root, then of the `beam` best per depth
        chosen_or_all, score = {}, {}
        frontier = [()]
        for d in range(1, cfg.depth + 1):
            level = []
            for p in frontier:
                logp = heads.project(state_of(p))[0].float().log_softmax(-1)
                top = logp.topk(cfg.top_k)
                for r in range(cfg.top_k):
                    q = p + (r,)
                    chosen_or_all[q] = int(top.indices[r])
                    score[q] = score.get(p, 0.0) + float(top.values[r])
                    level.append(q)
            frontier = sorted(level, key=lambda q: -score[q])[: cfg.beam]
    for p, tok in chosen.items():
        assert chosen_or_all[p] == tok, p
        assert len(p) == 1 or p[:-1] in chosen  # closed under ancestors
    worst = min(score[p] for p in chosen)
    assert all(score[q] <= worst + 1e-5 for q in score if q not in chosen)
    # a node's children depend on the node: the tree is not the same list under every parent
    d = drafter.propose(torch.tensor([3, 5]))  # no hidden state yet: the root alone
    assert d.tree.size == 1
    drafter.observe([0], 5, hidden=hidden)
    d = drafter.propose(torch.tensor([3, 5]))
    assert d.tree.size == 8 and int(d.tokens[0]) == 5
    assert sorted(d.tree.paths[1:]) == sorted(paths)


def test_dynamic_tree_merges_the_lookup_chain(seq_heads_random):
    """With a lookup branch the dynamic tree always has 1 + nodes + gamma rows: the chain follows
    the heads' nodes while its tokens are there, takes new rows only for the rest, and the rows it
    leaves free go to the heads' next-best nodes (checked against grow()'s best-first list)."""
    from speculant.drafters.lookup import LookupDrafter
    from speculant.drafters.medusa import DynamicTree
    heads, hidden, root = seq_heads_random, torch.randn(H), torch.tensor([5])
    cfg = DynamicTree(nodes=6, depth=3, top_k=3, beam=2)
    drafter = MedusaDrafter(heads, build_tree("2"), V, LookupDrafter(3), dynamic=cfg)
    best, toks = drafter.grow(hidden, root, 9)
    best_tok = dict(zip(best, toks.tolist()))
    drafter.observe([0], 5, hidden=hidden)

    def draft(context):
        d = drafter.propose(torch.tensor(context))
        by_path = dict(zip(d.tree.paths, d.tokens.tolist()))
        for p in d.tree.paths[1:]:  # siblings never repeat a token
            sibs = [by_path[q] for q in d.tree.paths[1:] if q[:-1] == p[:-1]]
            assert len(sibs) == len(set(sibs))
        return d, by_path

    def holds_chain(by_path, chain):  # the chain is a path from the root
        parent = ()
        for t in chain:
            kids = [p for p, x in by_path.items() if p and p[:-1] == parent and x == t]
            assert len(kids) == 1, (chain, t)
            parent = kids[0]

    # no n-gram match: all 9 rows are the heads' best 9 nodes
    d, by_path = draft([1, 2, 3, 4, 5])
    assert d.tree.size == 10 and {p: by_path[p] for p in best} == best_tok
    # a match whose continuation starts with the heads' two best nodes down one path: one new row,
    # so the heads keep their best 8
    a = best_tok[best[0]]
    kid = next(i for i, p in enumerate(best) if p[:-1] == best[0])
    assert kid < 8  # (the seeded heads' best child of the best node is among their best 8)
    b = best_tok[best[kid]]
    c = next(t for t in range(V) if all(best_tok.get(p) != t for p in best))
    d, by_path = draft([5, a, b, c, 9, 5])
    assert d.tree.size == 10
    holds_chain(by_path, [a, b, c])
    assert all(by_path[p] == best_tok[p] for p in best[:8])
    # a continuation the heads never drafted: 3 new rows under the root, the heads keep their best 6
    x, y, z = [t for t in range(V) if all(best_tok[p] != t for p in best if len(p) == 1)][:3]
    d, by_path = draft([5, x, y, z, 7, 5])
    assert d.tree.size == 10
    holds_chain(by_path, [x, y, z])
    assert all(by_path[p] == best_tok[p] for p in best[:6]) and sum(1 for p in by_path if p and p not in best[:6]) == 3


def test_dynamic_tree_errors(target, seq_heads_random):
    from speculant.drafters.medusa import DynamicTree
    with pytest.raises(ConfigError, match="depth 5 but the heads are trained for 3"):
        MedusaDrafter(seq_heads_random, build_tree("2"), V, dynamic=DynamicTree(depth=5))
    for bad in ("dynamic:x", "dynamic:1:2:3", "dyn:4"):
        with pytest.raises(ConfigError, match="malformed dynamic tree"):
            DynamicTree.parse(bad)
    with pytest.raises(ConfigError, match="nodes must be an integer >= 1"):
        DynamicTree.parse("dynamic:0")


@pytest.mark.parametrize("which", ["random_heads", "trained_heads"])
def test_dynamic_tree_of_medusa_heads(target, plain, request, which):
    """Medusa heads share one candidate list per depth, so a path's score is the sum of its ranks'
    log-probabilities: the dynamic tree is the best `nodes` paths of the Cartesian product (checked
    by enumerating it), and decoding with it is identical to plain greedy."""
    import itertools
    from speculant.drafters.lookup import LookupDrafter
    from speculant.drafters.medusa import DynamicTree
    heads = request.getfixturevalue(which)
    cfg = DynamicTree(nodes=9, depth=3, top_k=3)
    drafter = MedusaDrafter(heads, build_tree("2"), V, dynamic=cfg)
    hidden = torch.randn(H)
    paths, tokens = drafter.grow(hidden, torch.tensor([5]))
    with torch.no_grad():
        top = heads(hidden)[:3, :V].float().log_softmax(-1).topk(3)
    score = {p: sum(float(top.values[d, r]) for d, r in enumerate(p))
             for n in (1, 2, 3) for p in itertools.product(range(3), repeat=n)}
    assert len(paths) == 9 and all(len(p) == 1 or p[:-1] in paths for p in paths)
    assert tokens.tolist() == [int(top.indices[len(p) - 1, p[-1]]) for p in paths]
    worst = min(score[p] for p in paths)
    assert all(score[q] <= worst + 1e-5 for q in score if q not in paths)
    for prompt, ref in zip(prompts(), plain):
        for lookup in (None, LookupDrafter(3)):
            assert decode_to_end(target, MedusaDrafter(heads, build_tree("2"), V, lookup, dynamic=cfg), prompt).generated == ref


def test_default_hydra_tree_makes_room_for_the_lookup_chain(tmp_path):
    """hydra's default dynamic tree, depth 2: with tree_budget="fixed", 15 heads' nodes, and with a
    lookup branch of N, 15 - N (at least 4), so a step verifies the same 16 rows; sized against the
    pass cost (the default), at most DEFAULT_MAX_ROWS rows: 31 - N nodes. Greedy output still
    equals plain decoding."""
    import speculant
    from speculant import SpeculativeDecoder
    from speculant.api import DEFAULT_MAX_ROWS
    from speculant.heads import SequentialHeads
    from tiny import tiny_model_dir

    lm = speculant.load(tiny_model_dir(tmp_path / "m"), "float32")
    heads = SequentialHeads(HeadsConfig(3, 1, lm.model.config.hidden_size, lm.logits_dim, kind="sequential"),
                            lm.model.get_output_embeddings(), lm.model.get_input_embeddings())
    for budget, want in (("fixed", {0: 15, 4: 11, 8: 7, 12: 4, 30: 4}),
                         ("auto", {n: max(DEFAULT_MAX_ROWS - 1 - n, 4) for n in (0, 4, 8, 12, 30)})):
        nodes = {n: SpeculativeDecoder(lm, method="hydra", heads=heads, lookup_branch=n, dtype="float32",
                                       tree_budget=budget).dynamic.nodes for n in (0, 4, 8, 12, 30)}
        assert nodes == want, budget
    assert SpeculativeDecoder(lm, method="hydra", heads=heads, dtype="float32").dynamic.depth == 2
    plain = SpeculativeDecoder(lm, method="ar", dtype="float32")
    prompt = "w1 w2 w3 w1 w2 w3 w1"
    for budget in ("fixed", "auto"):
        dec = SpeculativeDecoder(lm, method="hydra", heads=heads, lookup_branch=12, dtype="float32", tree_budget=budget)
        assert dec.generate(prompt, 24).token_ids == plain.generate(prompt, 24).token_ids
    explicit = SpeculativeDecoder(lm, method="hydra", heads=heads, lookup_branch=12, tree="dynamic:20",
                                  dtype="float32")
    assert explicit.dynamic.nodes == 20  # a tree the user names is kept as it is


def test_default_medusa_tree_is_sized_per_step_unless_the_budget_is_fixed(tmp_path):
    """medusa with tree_budget="auto" (the default) grows a dynamic tree as deep as the heads, at
    most DEFAULT_MAX_ROWS rows with the lookup chain, sized per step; "fixed" keeps the static tree
    saved next to the heads. Greedy output equals plain decoding either way."""
    import speculant
    from speculant import SpeculativeDecoder
    from speculant.api import DEFAULT_MAX_ROWS
    from speculant.heads import SHIPPED_TREE_NAME, MedusaHeads, save_heads
    from speculant.trees.buffers import build_tree
    from tiny import tiny_model_dir

    lm = speculant.load(tiny_model_dir(tmp_path / "m"), "float32")
    heads = MedusaHeads(HeadsConfig(3, 1, lm.model.config.hidden_size, lm.logits_dim), lm.model.get_output_embeddings())
    save_heads(heads, tmp_path / "heads")
    (tmp_path / "heads" / SHIPPED_TREE_NAME).write_text("[[0], [1], [0, 0]]")
    plain = SpeculativeDecoder(lm, method="ar", dtype="float32")
    prompt = "w1 w2 w3 w1 w2 w3 w1"
    for n in (0, 8, 30):
        auto = SpeculativeDecoder(lm, method="medusa", heads=str(tmp_path / "heads"), lookup_branch=n, dtype="float32")
        assert auto.dynamic is not None and auto.sizer is not None
        assert auto.dynamic.nodes == max(DEFAULT_MAX_ROWS - 1 - n, 4) and auto.dynamic.depth == 0
        assert auto.generate(prompt, 24).token_ids == plain.generate(prompt, 24).token_ids
    fixed = SpeculativeDecoder(lm, method="medusa", heads=str(tmp_path / "heads"), dtype="float32", tree_budget="fixed")
    assert fixed.dynamic is None and fixed.sizer is None
    assert torch.equal(fixed.tree.mask, build_tree([[0], [1], [0, 0]]).mask)
    assert fixed.generate(prompt, 24).token_ids == plain.generate(prompt, 24).token_ids
