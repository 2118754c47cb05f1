"""Medusa heads: module shape and init, and the Medusa checkpoint layout (round trip, foreign
checkpoints written by hand, and clear errors for mismatched or corrupt ones)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from speculant.errors import ConfigError, ModelLoadError
from speculant.heads import HeadsConfig, MedusaHeads, ResBlock, load_heads, save_heads

from tiny import tiny_llama

V, H = 64, 48


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, vocab=V, hidden=H, scale=4.0)


def randomize(heads: MedusaHeads, seed: int = 0) -> MedusaHeads:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return heads


def cfg(shared: bool, K: int = 3, n: int = 2) -> HeadsConfig:
    return HeadsConfig(num_heads=K, num_layers=n, hidden_size=H, vocab_size=V, shared_lm_head=shared,
                       base_model="tiny-llama")


@pytest.mark.parametrize("shared", [True, False])
def test_shapes_and_identity_init(target, shared):
    lm_head = target.get_output_embeddings()
    heads = MedusaHeads(cfg(shared), lm_head)
    x = torch.randn(2, 5, H)
    out = heads(x)
    assert out.shape == (3, 2, 5, V)
    assert heads(x[0, 0]).shape == (3, V)
    # zero-initialised blocks + (shared or copied) output layer: every head starts as lm_head
    ref = lm_head(x)
    for k in range(3):
        torch.testing.assert_close(out[k], ref)


def test_blocks_have_their_own_parameters(target):
    heads = MedusaHeads(cfg(False, K=2, n=3), target.get_output_embeddings())
    blocks = [m for m in heads.modules() if isinstance(m, ResBlock)]
    assert len(blocks) == 6
    assert len({id(b.linear.weight) for b in blocks}) == 6
    assert len({b.linear.weight.data_ptr() for b in blocks}) == 6
    # per-head projections are copies, not the target's tensor
    assert target.get_output_embeddings().weight.data_ptr() not in {p.data_ptr() for p in heads.parameters()}


def test_medusa_parameter_names(target):
    per_head = MedusaHeads(cfg(False, K=2, n=1), target.get_output_embeddings())
    assert sorted(per_head.medusa_state_dict()) == [
        "0.0.linear.bias", "0.0.linear.weight", "0.1.weight",
        "1.0.linear.bias", "1.0.linear.weight", "1.1.weight"]
    shared = MedusaHeads(cfg(True, K=2, n=1), target.get_output_embeddings())
    assert sorted(shared.medusa_state_dict()) == [
        "0.0.linear.bias", "0.0.linear.weight", "1.0.linear.bias", "1.0.linear.weight"]
    # the target's output layer is neither owned nor trained by shared heads
    assert sum(p.numel() for p in shared.parameters()) == 2 * (H * H + H)


def test_shared_output_layer_stays_frozen(target):
    lm_head = target.get_output_embeddings()
    heads = randomize(MedusaHeads(cfg(True), lm_head))
    lm_head.weight.grad = None
    heads(torch.randn(4, H)).logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in heads.parameters())
    assert lm_head.weight.grad is None


def test_forward_matches_the_formula(target):
    lm_head = target.get_output_embeddings()
    heads = randomize(MedusaHeads(cfg(True, K=2, n=2), lm_head))
    x = torch.randn(3, H)
    for k, head in enumerate(heads.heads):
        y = x
        for block in head:
            y = y + F.silu(block.linear(y))
        torch.testing.assert_close(heads(x)[k], lm_head(y))


@pytest.mark.parametrize("shared", [True, False])
def test_round_trip(tmp_path, target, shared):
    heads = randomize(MedusaHeads(cfg(shared), target.get_output_embeddings()))
    save_heads(heads, tmp_path / "h")
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    assert raw["medusa_num_heads"] == 3 and raw["medusa_num_layers"] == 2
    assert raw["base_model_name_or_path"] == "tiny-llama"
    assert (raw["hidden_size"], raw["vocab_size"], raw["speculant_shared_lm_head"]) == (H, V, shared)
    assert set(load_file(str(tmp_path / "h" / "model.safetensors"))) == set(heads.medusa_state_dict())
    loaded = load_heads(tmp_path / "h", target)
    assert loaded.config == heads.config
    x = torch.randn(5, H)
    torch.testing.assert_close(loaded(x), heads(x))


def write_checkpoint(directory, K=2, n=1, hidden=H, vocab=V, proj=True, config_extra=None, seed=0):
    """A Medusa-layout checkpoint written by hand (not by save_heads), as other tools write it."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k in range(K):
        for j in range(n):
            state[f"{k}.{j}.linear.weight"] = 0.1 * torch.randn(hidden, hidden, generator=g)
            state[f"{k}.{j}.linear.bias"] = 0.1 * torch.randn(hidden, generator=g)
        if proj:
            state[f"{k}.{n}.weight"] = 0.1 * torch.randn(vocab, hidden, generator=g)
    directory.mkdir(parents=True, exist_ok=True)
    config = {"medusa_num_heads": K, "medusa_num_layers": n, "base_model_name_or_path": "some/base",
              **(config_extra or {})}
    (directory / "config.json").write_text(json.dumps(config))
    save_file(state, str(directory / "model.safetensors"))
    return state


@pytest.mark.parametrize("proj", [True, False])
def test_loads_a_handwritten_medusa_checkpoint(tmp_path, target, proj):
    state = write_checkpoint(tmp_path / "m", K=2, n=1, proj=proj)
    heads = load_heads(tmp_path / "m", target)
    assert heads.config.shared_lm_head == (not proj)  # inferred: no projection tensors -> shared
    assert heads.config.base_model == "some/base"
    x = torch.randn(4, H)
    lm_w = target.get_output_embeddings().weight
    for k in range(2):
        y = x + F.silu(x @ state[f"{k}.0.linear.weight"].T + state[f"{k}.0.linear.bias"])
        expected = y @ (state[f"{k}.1.weight"] if proj else lm_w).T
        torch.testing.assert_close(heads(x)[k], expected)


def test_medusa_release_file_name_is_read(tmp_path, target):
    write_checkpoint(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "medusa_lm_head.safetensors")
    assert load_heads(tmp_path / "m", target).num_heads == 2


@pytest.mark.parametrize("kwargs, config_extra, msg", [
    (dict(hidden=32), None, "hidden size"),
    (dict(vocab=80), {"vocab_size": 80}, "vocabulary of 80"),
    (dict(), {"hidden_size": 32}, "hidden size"),
    (dict(vocab=80), None, "vocabulary of 80"),  # sizes read off the tensors
])
def test_mismatch_with_target(tmp_path, target, kwargs, config_extra, msg):
    write_checkpoint(tmp_path / "m", config_extra=config_extra, **kwargs)
    with pytest.raises(ModelLoadError, match=msg):
        load_heads(tmp_path / "m", target)


def test_missing_and_corrupt_files(tmp_path, target):
    with pytest.raises(ModelLoadError, match="no heads checkpoint"):
        load_heads(tmp_path / "nowhere", target)
    d = tmp_path / "m"
    write_checkpoint(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_heads(d, target)
    (d / "config.json").write_text(json.dumps({"hidden_size": H}))
    with pytest.raises(ModelLoadError, match="medusa_num_heads"):
        load_heads(d, target)
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_heads(d, target)
    write_checkpoint(d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_heads(d, target)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_heads(d, target)


def test_missing_tensor_and_bad_config(tmp_path, target):
    d = tmp_path / "m"
    state = write_checkpoint(d, K=2, n=1)
    del state["1.0.linear.bias"]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensors \['1.0.linear.bias'\]"):
        load_heads(d, target)
    write_checkpoint(d, K=2, n=1, config_extra={"medusa_num_heads": 3})
    with pytest.raises(ModelLoadError, match="missing tensors"):
        load_heads(d, target)
    write_checkpoint(d, K=2, n=1, hidden=32, config_extra={"hidden_size": H})  # config and tensors disagree
    with pytest.raises(ModelLoadError, match=r"shape \(32, 32\).*corrupt"):
        load_heads(d, target)
    write_checkpoint(d, K=2, n=1, config_extra={"medusa_num_heads": 0})
    with pytest.raises(ModelLoadError, match="num_heads"):
        load_heads(d, target)


def test_zero_blocks(tmp_path, target):
    lm_head = target.get_output_embeddings()
    heads = MedusaHeads(cfg(True, K=2, n=0), lm_head)  # no parameters at all: lm_head twice
    x = torch.randn(H)
    torch.testing.assert_close(heads(x), torch.stack([lm_head(x)] * 2))
    save_heads(heads, tmp_path / "z")
    torch.testing.assert_close(load_heads(tmp_path / "z", target)(x), heads(x))


def test_config_validation(target):
    with pytest.raises(ConfigError, match="num_heads"):
        HeadsConfig(0, 1, H, V)
    with pytest.raises(ConfigError, match="num_layers"):
        HeadsConfig(1, -1, H, V)
    with pytest.raises(ConfigError, match="output layer"):
        MedusaHeads(cfg(True))
    with pytest.raises(ModelLoadError, match="hidden size"):
        MedusaHeads(HeadsConfig(2, 1, 32, V), target.get_output_embeddings())


# ------------------------------------------------------------------ sequential heads

def seq_cfg(K: int = 3, n: int = 2) -> HeadsConfig:
    return HeadsConfig(K, n, H, V, base_model="tiny-llama", kind="sequential")


def test_sequential_step_matches_the_formula_and_unrolls(target):
    from speculant.heads import SequentialHeads
    lm_head, emb = target.get_output_embeddings(), target.get_input_embeddings()
    heads = randomize(SequentialHeads(seq_cfg(), lm_head, emb))
    x, toks = torch.randn(4, H), torch.randint(0, V, (4, 3))
    e = emb.weight[toks[:, 0]]
    e = e / e.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * heads.embed_scale
    y = heads.fc(torch.cat([x, e], -1))
    for block in heads.blocks:
        y = y + F.silu(block.linear(y))
    torch.testing.assert_close(heads.step(x, toks[:, 0]), y)
    s, want = x, []
    for d in range(3):
        s = heads.step(s, toks[:, d])
        want.append(lm_head(s))
    torch.testing.assert_close(heads(x, toks), torch.stack(want))
    torch.testing.assert_close(heads(x, toks[:, :2]), torch.stack(want[:2]))  # a shorter unroll
    with pytest.raises(ValueError, match="tokens"):
        heads(x)  # no tokens: nothing to unroll from
    fresh = SequentialHeads(seq_cfg(), lm_head, emb)  # W = [I, 0], blocks zero: the state passes through
    torch.testing.assert_close(fresh.step(x, toks[:, 0]), x)


def test_sequential_round_trip_and_errors(tmp_path, target):
    from speculant.heads import SequentialHeads
    heads = randomize(SequentialHeads(seq_cfg(), target.get_output_embeddings(), target.get_input_embeddings()))
    save_heads(heads, tmp_path / "s")
    raw = json.loads((tmp_path / "s" / "config.json").read_text())
    assert raw["speculant_head_kind"] == "sequential" and raw["medusa_num_heads"] == 3
    loaded = load_heads(tmp_path / "s", target)
    assert isinstance(loaded, SequentialHeads) and loaded.config == heads.config
    x, toks = torch.randn(5, H), torch.randint(0, V, (5, 3))
    torch.testing.assert_close(loaded(x, toks), heads(x, toks))
    # a Medusa checkpoint relabelled as sequential: a clear error naming the missing tensors
    save_heads(randomize(MedusaHeads(cfg(True), target.get_output_embeddings())), tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**raw, "speculant_head_kind": "sequential"}))
    with pytest.raises(ModelLoadError, match="sequential heads of depth 3.*missing tensors"):
        load_heads(tmp_path / "m", target)
    (tmp_path / "m" / "config.json").write_text(json.dumps({**raw, "speculant_head_kind": "hydra"}))
    with pytest.raises(ModelLoadError, match="kind must be one of"):
        load_heads(tmp_path / "m", target)
    with pytest.raises(ConfigError, match="shared_lm_head"):
        HeadsConfig(2, 1, H, V, shared_lm_head=False, kind="sequential")
    with pytest.raises(ModelLoadError, match="input embeddings"):
        SequentialHeads(seq_cfg(), target.get_output_embeddings(), torch.nn.Embedding(V, H + 1))


def test_context_layer_is_causal_incremental_round_trips_and_starts_as_the_identity(tmp_path, target):
    """The prefix-attention layer: a fresh one is the identity; position t's output depends on
    positions <= t only; decoding it piece by piece through a ContextCache gives the whole-sequence
    output; it is saved and loaded with the heads; bad configs are clear errors."""
    import dataclasses
    from speculant.heads import ContextCache, SequentialHeads
    lm, emb = target.get_output_embeddings(), target.get_input_embeddings()
    ccfg = dataclasses.replace(seq_cfg(), context_size=32)
    h = torch.randn(1, 9, H)
    torch.testing.assert_close(SequentialHeads(ccfg, lm, emb).context(h), h)
    heads = randomize(SequentialHeads(ccfg, lm, emb))
    full = heads.context(h)[0]
    assert not torch.allclose(full, h[0], atol=1e-3)
    later = h.clone()
    later[0, 6:] += 1.0
    changed = heads.context(later)[0]
    torch.testing.assert_close(changed[:6], full[:6])
    assert not torch.allclose(changed[6:], full[6:], atol=1e-3)
    cache = ContextCache()
    parts = [heads.context.extend(cache, h[0, a:b]) for a, b in ((0, 4), (4, 5), (5, 9))]
    torch.testing.assert_close(torch.cat(parts), full)
    assert cache.length == 9
    # a bf16 layer keeps its cache in float32 and attends in float32: still its own forward
    half = copy.deepcopy(heads.context).to(torch.bfloat16)
    half_cache = ContextCache()
    half_parts = [half.extend(half_cache, h[0, a:b].bfloat16()) for a, b in ((0, 4), (4, 5), (5, 9))]
    assert half_cache.k.dtype == torch.float32 and half_parts[0].dtype == torch.bfloat16
    torch.testing.assert_close(torch.cat(half_parts).float(), half(h.bfloat16())[0].float(), atol=0.05, rtol=0.02)
    save_heads(heads, tmp_path / "c")
    assert json.loads((tmp_path / "c" / "config.json").read_text())["speculant_context_size"] == 32
    loaded = load_heads(tmp_path / "c", target).float()
    assert loaded.config == ccfg
    torch.testing.assert_close(loaded.context(h), heads.context(h))
    # the config promises a context layer the weights lack: a clear error naming the missing tensors
    save_heads(randomize(SequentialHeads(seq_cfg(), lm, emb)), tmp_path / "s")
    raw = json.loads((tmp_path / "s" / "config.json").read_text())
    (tmp_path / "s" / "config.json").write_text(json.dumps({**raw, "speculant_context_size": 32}))
    with pytest.raises(ModelLoadError, match="missing tensors.*context"):
        load_heads(tmp_path / "s", target)
    with pytest.raises(ConfigError, match="context .*option of sequential heads"):
        HeadsConfig(2, 1, H, V, context_size=8)
    with pytest.raises(ConfigError, match="context_size must be"):
        HeadsConfig(2, 1, H, V, kind="sequential", context_size=-1)


def test_sequential_draft_vocabulary(tmp_path, target):
    """With a draft vocabulary the heads rank only those tokens (the same order as the full logits
    restricted to them); it is saved, reloaded, and a corrupt one is a clear error."""
    from speculant.heads import SequentialHeads
    cfg = HeadsConfig(3, 1, H, V, base_model="tiny-llama", kind="sequential", draft_vocab=16)
    heads = randomize(SequentialHeads(cfg, target.get_output_embeddings(), target.get_input_embeddings()))
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:16]
    heads.set_draft_vocab(vocab)
    state = torch.randn(4, H)
    with torch.no_grad():
        top = heads.draft_topk(state, 5)
        masked = heads.mask_to_draft_vocab(heads.project(state))
        assert top.tolist() == masked.topk(5, dim=-1).indices.tolist()
        assert set(top.flatten().tolist()) <= set(vocab.tolist())
        limited = heads.draft_topk(state, 3, limit=32)  # a target vocabulary of 32: ids >= 32 never proposed
        assert int(limited.max()) < 32
    save_heads(heads, tmp_path / "dv")
    assert json.loads((tmp_path / "dv" / "config.json").read_text())["speculant_draft_vocab"] == 16
    loaded = load_heads(tmp_path / "dv", target)
    assert loaded.draft_vocab.tolist() == sorted(vocab.tolist())
    with torch.no_grad():
        assert loaded.draft_topk(state, 5).tolist() == top.tolist()
    weights = load_file(str(tmp_path / "dv" / "model.safetensors"))
    weights["draft_vocab"] = torch.zeros(16, dtype=torch.long)  # 16 copies of token 0
    save_file(weights, str(tmp_path / "dv" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="draft vocabulary must be 16 distinct"):
        load_heads(tmp_path / "dv", target)
    with pytest.raises(ConfigError, match="option of sequential heads"):
        HeadsConfig(3, 1, H, V, draft_vocab=16)


def _coarse_kind():
    """The low-bit copy drafting shortlists through (int4: speculant's int4 kernel where it runs,
    else PyTorch's int4 matmul)."""
    from speculant.runtime.quant import Int4Linear
    return Int4Linear


def test_sequential_coarse_ranking_matches_the_exact_ranking():
    """Drafting shortlists tokens through an int4 copy of the draft vocabulary's output rows (with
    speculant's int4 kernel or PyTorch's int4 matmul) and ranks the shortlist exactly: the top-k then
    equals the exact top-k wherever the exact one is inside the shortlist (here: nearly always),
    and the log-probabilities stay close to the exact log-softmax."""
    from speculant.heads import SequentialHeads
    Hc, Vc = 128, 4096
    torch.manual_seed(0)
    lm = torch.nn.Linear(Hc, Vc, bias=False)
    emb = torch.nn.Embedding(Vc, Hc)
    cfg = HeadsConfig(2, 1, Hc, Vc, kind="sequential", draft_vocab=2048)
    heads = SequentialHeads(cfg, lm, emb)
    heads.set_draft_vocab(torch.arange(0, Vc, 2))
    state = torch.randn(64, Hc) * 3
    with torch.no_grad():
        heads.coarse_ranking = False
        exact, exact_lp = heads.draft_topk(state, 4, logprobs=True)
        heads.coarse_ranking = True
        coarse, coarse_lp = heads.draft_topk(state, 4, logprobs=True)
    assert isinstance(heads._draft_rows[3], _coarse_kind())  # the low-bit copy was built and used
    assert (coarse == exact).all(-1).float().mean() >= 0.9
    assert (coarse[:, 0] == exact[:, 0]).float().mean() >= 0.97
    same = (coarse == exact).all(-1)
    torch.testing.assert_close(coarse_lp[same], exact_lp[same], atol=0.15, rtol=0)
    assert set(coarse.flatten().tolist()) <= set(range(0, Vc, 2))


def test_medusa_coarse_ranking_matches_the_exact_ranking():
    """Medusa heads drafting through the shared output layer shortlist with its int4 copy and rank the shortlist exactly: nearly always the exact top-k."""
    Hc, Vc = 128, 4096
    torch.manual_seed(0)
    lm = torch.nn.Linear(Hc, Vc, bias=False)
    heads = MedusaHeads(HeadsConfig(3, 1, Hc, Vc), lm)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn(p.shape))
    agree = top1 = 0
    for i in range(40):
        hidden = torch.randn(Hc) * 3
        heads.coarse_ranking = False
        exact = heads.draft_topk(hidden, 4, 3, 4000)
        assert exact.tolist() == heads(hidden)[:3, :4000].topk(4).indices.tolist()
        heads.coarse_ranking = True
        coarse = heads.draft_topk(hidden, 4, 3, 4000)
        agree += int((coarse == exact).all(-1).sum()); top1 += int((coarse[:, 0] == exact[:, 0]).sum())
        assert int(coarse.max()) < 4000
        # with log-probabilities (dynamic trees): the same tokens, scored close to the exact log-softmax
        idx, logp = heads.draft_topk(hidden, 4, 3, 4000, logprobs=True)
        assert torch.equal(idx, coarse) and logp.shape == (3, 4) and bool((logp <= 0.05).all())
        ref = heads(hidden)[:3, :4000].float().log_softmax(-1).gather(-1, idx)
        torch.testing.assert_close(logp, ref, atol=0.1, rtol=0.0)
        heads.coarse_ranking = False
        idx, logp = heads.draft_topk(hidden, 4, 3, 4000, logprobs=True)
        assert torch.equal(idx, exact)
        torch.testing.assert_close(logp, heads(hidden)[:3, :4000].float().log_softmax(-1).gather(-1, idx))
    assert isinstance(heads._coarse[2], _coarse_kind())
    assert agree >= 0.9 * 120 and top1 >= 0.97 * 120


def test_coarse_ranker_picks_int4_then_int8_and_keeps_the_exact_top():
    """int4 where the rows' width is a multiple of 64 (a count of rows that is not a multiple of 16
    is padded, the padding never ranked), int8 for other widths, none for small vocabularies; either
    shortlist, re-ranked exactly, keeps the exact top-1."""
    from speculant.heads.projection import coarse_ranker, shortlist_topk
    from speculant.runtime.quant import Int4Linear, Int8Linear
    torch.manual_seed(0)
    assert coarse_ranker(None) is None and coarse_ranker(torch.randn(512, 128)) is None
    for n, width, kind in ((2048, 128, Int4Linear), (2047, 128, Int4Linear), (2048, 96, Int8Linear)):
        torch.manual_seed(1)
        rows = (torch.randn(n, width) * 0.05).to(torch.bfloat16)
        coarse = coarse_ranker(rows)
        assert isinstance(getattr(coarse, "layer", coarse), kind)
        states = torch.randn(32, width).to(torch.bfloat16)
        idx, values, rough = shortlist_topk(coarse, rows, states, 4)
        assert rough.shape == (32, n) and int(idx.max()) < n
        exact = torch.nn.functional.linear(states, rows).float().topk(4, dim=-1)
        assert (idx[:, 0] == exact.indices[:, 0]).float().mean() >= 0.95
        torch.testing.assert_close(values[:, 0], exact.values[:, 0], atol=1e-2, rtol=1e-2)


def test_bf16_heads_become_int4_where_bf16_matmuls_are_slow():
    """On a CPU without oneDNN's packed bf16 linear but with speculant's x86 int4 kernel, loaded
    bf16 heads draft through int4 linear layers (their outputs close to the bf16 ones); elsewhere
    they stay as they are."""
    from speculant.heads import SequentialHeads
    from speculant.kernels import x86_kernels
    from speculant.store.loading import int4_heads
    from speculant.runtime.packing import available
    from speculant.runtime.quant import Int4Linear
    torch.manual_seed(0)
    lm, emb = torch.nn.Linear(64, 512, bias=False), torch.nn.Embedding(512, 64)
    heads = SequentialHeads(HeadsConfig(2, 1, 64, 512, kind="sequential"), lm, emb)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.3 * torch.randn(p.shape))
    f32 = heads.eval()
    assert not int4_heads(f32)  # float32 heads: never
    bf16 = SequentialHeads(HeadsConfig(2, 1, 64, 512, kind="sequential"), lm, emb)
    bf16.load_state_dict(f32.state_dict())
    bf16 = bf16.to(torch.bfloat16).eval()
    state, tokens = torch.randn(5, 64).to(torch.bfloat16), torch.randint(0, 512, (5,))
    want = bf16.step(state, tokens).float()
    converted = int4_heads(bf16)
    assert converted == (not available() and x86_kernels() is not None)
    if not converted:
        pytest.skip("this CPU has a fast bf16 matmul (or no x86 int4 kernel): the heads stay bf16")
    assert isinstance(bf16.fc, Int4Linear) and isinstance(bf16.blocks[0].linear, Int4Linear)
    got = bf16.step(state, tokens).float()
    assert 0 < (got - want).norm() / want.norm() < 0.2  # int4 in groups of 64: ~10% per layer on random weights
