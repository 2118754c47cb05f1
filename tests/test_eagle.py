"""The EAGLE drafter (speculant.eagle): its network's decoding paths agree with its teacher-forced
forward (committed pairs, chains and branching trees under the tree mask), and decoding with it
is lossless: greedy output identical to plain decoding on both runtimes, with and without the
lookup chain and the cost-sized tree."""

from __future__ import annotations

import json
import os

import pytest
import torch

from speculant.backends.base import HiddenNeed
from speculant.backends.hf import HFBackend
from speculant.backends.native import NativeBackend, NativeModel
from speculant.tuning.costmodel import PassCost
from speculant.drafters.base import NoDrafter
from speculant.drafters.dynamic_tree import DynamicTree, DynamicTreeDrafter
from speculant.drafters.proposers import Stepwise
from speculant.drafters.lookup import LookupDrafter
from speculant.tuning.sizing import TreeSizer
from speculant.eagle import EagleCache, EagleConfig, EagleDrafter, EagleModel
from speculant.eagle.drafter import EagleSteps
from speculant.heads.attention import grouped_attention
from speculant.errors import ConfigError, ModelLoadError

from helpers import decode_to_end, greedy_records
from tiny import fixed_prompts, tiny_qwen2

V = 64


def eagle_for(target, seed: int = 0, depth: int = 4, scale: float = 0.3, dtype=torch.float32,
              **options) -> EagleModel:
    """A drafter with random weights for ``target`` (a transformers model)."""
    cfg = EagleConfig.for_target(target.config, intermediate_size=96, depth=depth, **options)
    model = EagleModel(cfg, target.get_output_embeddings(), target.get_input_embeddings())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(scale * torch.randn(p.shape, generator=g))
    return model.to(dtype).eval()


@pytest.fixture(scope="module")
def target():
    return tiny_qwen2(seed=0, scale=4.0)


def test_config_checks_and_round_trip(target):
    cfg = EagleConfig.for_target(target.config, depth=5)
    assert cfg.attention_bias and cfg.num_key_value_heads == 2 and cfg.rope_theta == 1e6 and cfg.depth == 5
    assert EagleConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ConfigError, match="key-value groups"):
        EagleConfig(64, 96, 4, 3, V)
    with pytest.raises(ConfigError, match="depth must be an integer >= 1"):
        EagleConfig(64, 96, 4, 2, V, depth=0)
    with pytest.raises(ModelLoadError, match="not a speculant EAGLE drafter config"):
        EagleConfig.from_json({"hidden_size": 64})
    other = tiny_qwen2(seed=0, vocab=80)
    with pytest.raises(ModelLoadError, match="trained for another model"):
        EagleModel(cfg, other.get_output_embeddings(), other.get_input_embeddings())


def test_parameter_names_are_eagle_checkpoint_names(target):
    names = set(eagle_for(target).state_dict())
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.q_proj.bias",
            "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.k_proj.bias", "layers.0.self_attn.v_proj.weight",
            "layers.0.self_attn.v_proj.bias", "layers.0.self_attn.o_proj.weight",
            "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} == names


def test_committed_pairs_equal_the_teacher_forced_forward(target):
    """extend, in chunks of any size, gives the rows forward gives for the whole sequence (in
    float64: the same sums up to rounding)."""
    model = eagle_for(target, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    hidden, tokens = torch.randn(13, 64, generator=g, dtype=torch.float64), torch.randint(0, V, (13,), generator=g)
    ref = model(hidden[None], tokens[None])[0]
    cache = EagleCache()
    out = torch.cat([model.extend(cache, hidden[a:b], tokens[a:b]) for a, b in ((0, 5), (5, 6), (6, 13))])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert cache.length == 13


def test_extend_last_commits_the_same_pairs_and_gives_the_last_feature(target):
    """extend_last (what a prompt's begin and every commit run) keeps the keys and values extend
    keeps, bit for bit, and gives extend's last row (float64), on an empty cache and after pairs."""
    model = eagle_for(target, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    hidden, tokens = torch.randn(13, 64, generator=g, dtype=torch.float64), torch.randint(0, V, (13,), generator=g)
    full, last = EagleCache(), EagleCache()
    for a, b in ((0, 9), (9, 10), (10, 13)):
        want = model.extend(full, hidden[a:b], tokens[a:b])[-1]
        got = model.extend_last(last, hidden[a:b], tokens[a:b])
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        assert last.length == full.length == b
        assert torch.equal(last.view()[0], full.view()[0]) and torch.equal(last.view()[1], full.view()[1])
    wrong = model.extend_last(EagleCache(), hidden[:9], tokens[:9].roll(1))  # negative control
    assert not torch.allclose(wrong, model.extend(EagleCache(), hidden[:9], tokens[:9])[-1])


def test_tree_steps_equal_each_path_committed(target):
    """A tree drafted in steps (two children of the root, each expanded; siblings must not see
    each other) gives every node the feature that committing its own path gives (float64)."""
    model = eagle_for(target, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    hidden, tokens = torch.randn(7, 64, generator=g, dtype=torch.float64), torch.randint(0, V, (7,), generator=g)
    cache = EagleCache()
    root = model.extend(cache, hidden, tokens)[-1]  # the root's feature
    kids = torch.tensor([3, 9])  # depth 1
    f1 = model.tree_step(cache, None, root.expand(2, -1), kids, torch.full((2,), 7))
    grand = torch.tensor([11, 12, 13])  # depth 2: children of kid 0, kid 1, kid 1
    parent = torch.tensor([0, 1, 1])
    sees = torch.eye(2, dtype=torch.bool)[parent]
    f2 = model.tree_step(cache, sees, f1[parent], grand, torch.full((3,), 8))
    assert (cache.length, cache.staged) == (7, 5)
    with pytest.raises(ValueError, match="which of the 5 staged nodes"):
        model.tree_step(cache, sees, f1[parent], grand, torch.full((3,), 8))
    committed = cache.view()[0].clone()
    model.extend(cache, hidden[:1], tokens[:1])  # a commit drops the staged nodes
    assert cache.staged == 0 and torch.equal(cache.view()[0][:, :7], committed)
    for j in range(3):
        p = int(parent[j])
        alone = EagleCache()
        model.extend(alone, hidden, tokens)
        path = model.extend(alone, torch.stack([root, f1[p]]), torch.stack([kids[p], grand[j]]))
        torch.testing.assert_close(path[0], f1[p], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(path[1], f2[j], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_attention_is_attention_for_sharp_scores_and_masks(dtype):
    """Decoding's attention (float32 inside, scores far below a row's largest clamped) equals a
    float64 masked softmax attention with each query head reading its key/value head, also where
    scores spread over hundreds (the clamp and the mask must not add weight anywhere)."""
    g = torch.Generator().manual_seed(0)
    Hq, Hkv, n, L, D = 6, 2, 5, 40, 16
    q, keys, values = (torch.randn(s, generator=g) for s in ((Hq, n, D), (Hkv, L, D), (Hkv, L, D)))
    q = q * 30  # scores up to a few hundred: most weights are below e^-80 of their row's largest
    mask = torch.rand(n, L, generator=g) < 0.5
    mask[:, 0] = True
    got = grouped_attention(q.to(dtype), keys.to(dtype), values.to(dtype), mask)
    assert got.dtype == dtype
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.to(dtype).double(), keys.to(dtype).double().repeat_interleave(Hq // Hkv, 0),
        values.to(dtype).double().repeat_interleave(Hq // Hkv, 0), attn_mask=mask)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
    flipped = grouped_attention(q.to(dtype), keys.to(dtype), values.to(dtype), ~mask | (torch.arange(L) == 0))
    assert (flipped - got).abs().max() > 0.1  # the mask is read


def test_narrowing_keeps_the_units_that_add_most(target):
    """narrow_mlp keeps the MLP units whose terms are largest on the sample: units with a zero
    output column add nothing and go first (the function is unchanged), every other weight and
    buffer is kept, and a width outside 1 .. I is refused."""
    from speculant.eagle.narrow import narrow_mlp, unit_importance

    model = eagle_for(target, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    hidden, tokens = torch.randn(2, 9, 64, generator=g, dtype=torch.float64), torch.randint(0, V, (2, 9), generator=g)
    dead = torch.arange(0, 96, 3)  # a third of the 96 units add nothing
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight[:, dead] = 0
    scores = unit_importance(model, hidden, tokens)
    assert scores.shape == (96,) and (scores[dead] == 0).all() and (scores.sum() > 0)
    narrow = narrow_mlp(model, 64, hidden, tokens)
    assert narrow.config.intermediate_size == 64 and narrow.layers[0].mlp.down_proj.weight.shape == (64, 64)
    torch.testing.assert_close(narrow(hidden, tokens), model(hidden, tokens), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(narrow.fc.weight, model.fc.weight)
    narrower = narrow_mlp(model, 32, hidden, tokens)  # live units dropped: a different function
    assert (narrower(hidden, tokens) - model(hidden, tokens)).abs().max() > 1e-3
    for width in (0, 97):
        with pytest.raises(ConfigError, match="narrowed to 1 .. 96 units"):
            narrow_mlp(model, width, hidden, tokens)


def _native(target, dtype=torch.float32):
    return NativeBackend(NativeModel.from_hf(target.to(dtype)))


@pytest.mark.parametrize("runtime", ["hf", "native"])
def test_eagle_decoding_equals_plain_decoding(target, runtime):
    backend = HFBackend(target) if runtime == "hf" else _native(target)
    model = eagle_for(target)
    sizer = TreeSizer(PassCost((1, 8, 16, 32), (10.0, 11.0, 12.0, 15.0)), max_rows=32)
    drafters = [EagleDrafter(model, DynamicTree(nodes=10), V),
                EagleDrafter(model, DynamicTree(nodes=6, depth=3, top_k=4, beam=2), V, LookupDrafter(3)),
                EagleDrafter(model, DynamicTree(nodes=12), V, LookupDrafter(3), sizer=sizer)]
    for prompt in fixed_prompts(V):
        plain = decode_to_end(backend, NoDrafter(), prompt, n=30).generated
        for drafter in drafters:
            state = decode_to_end(backend, drafter, prompt, n=30)
            assert state.generated == plain
        cache = drafters[0].proposer.source.cache
        assert cache is not None and cache.length == prompt.shape[0] + 29


class _Oracle(EagleSteps):
    """Ranks first, below every node, the token plain decoding writes there (``truth``: prompt +
    plain output), so that long paths are accepted and committed; the network still computes
    every feature."""

    def __init__(self, *args, truth: list[int], **kwargs):
        super().__init__(*args, **kwargs)
        self.truth = truth

    def children(self, features, depth, k):
        tok, logp = super().children(features, depth, k)
        at = self.cache.length + depth  # the position of a node of this depth (the context is one longer than the cache)
        if at < len(self.truth):
            tok, logp = tok.clone(), logp.clone()
            want = self.truth[at]
            for row in tok:
                hit = (row == want).nonzero()
                j = int(hit[0]) if hit.numel() else row.shape[0] - 1
                row[j], row[0] = row[0].clone(), want
            logp[:, 0] = 0.0
        return tok, logp


def _oracle(model, dynamic, V, truth):
    return DynamicTreeDrafter(Stepwise(_Oracle(model, V, truth=truth)), dynamic, V)


@pytest.mark.parametrize("runtime", ["hf", "native"])
def test_accepted_paths_are_committed_and_decoding_stays_plain(target, runtime):
    """Whole accepted paths (up to the depth) go through observe's commit: with proposals that
    are right, every step accepts several tokens, and the output is still plain decoding's; the
    drafter's cache holds one pair per position."""
    backend = HFBackend(target) if runtime == "hf" else _native(target)
    prompt = fixed_prompts(V)[0]
    plain = decode_to_end(backend, NoDrafter(), prompt, n=30).generated
    drafter = _oracle(eagle_for(target), DynamicTree(nodes=6, depth=3, top_k=2, beam=1), V,
                      truth=prompt.tolist() + plain)
    state = decode_to_end(backend, drafter, prompt, n=30)
    assert state.generated == plain
    assert state.stats.tokens_per_call > 2.5
    # one pair per position decoded (the last step's path may run past the 30 tokens kept)
    assert prompt.shape[0] + 29 <= drafter.proposer.source.cache.length <= prompt.shape[0] + 29 + 3


def test_saved_drafters_load_back_and_damaged_ones_are_named(target, tmp_path):
    from speculant.eagle.checkpoint import load_eagle, save_eagle

    model = eagle_for(target)
    out = save_eagle(model, tmp_path / "eagle")
    loaded = load_eagle(out, target)
    g = torch.Generator().manual_seed(3)
    hidden, tokens = torch.randn(5, 64, generator=g), torch.randint(0, V, (5,), generator=g)
    assert torch.equal(loaded(hidden[None], tokens[None]), model(hidden[None], tokens[None]))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # no temporary left
    with pytest.raises(ModelLoadError, match="no EAGLE drafter at"):
        load_eagle(tmp_path / "nothing", target)
    (out / "model.safetensors").write_bytes(b"\x00" * 12)
    with pytest.raises(ModelLoadError, match="model.safetensors is corrupt"):
        load_eagle(out, target)
    save_eagle(model, out)
    (out / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json is corrupt"):
        load_eagle(out, target)
    other = tiny_qwen2(seed=0, vocab=80)
    save_eagle(model, out)
    with pytest.raises(ModelLoadError, match="trained for another model"):
        load_eagle(out, other)


def test_the_api_decodes_with_a_saved_drafter(tmp_path):
    """SpeculativeDecoder(method="eagle", heads=DIR), with and without the lookup branch: the
    output of plain decoding; a heads directory of another kind is refused with the method to use."""
    from transformers import AutoModelForCausalLM

    from speculant.api import SpeculativeDecoder
    from speculant.eagle.checkpoint import save_eagle
    from speculant.errors import ConfigError as Refused
    from tiny import tiny_model_dir

    target_dir = tiny_model_dir(tmp_path / "target")
    hf = AutoModelForCausalLM.from_pretrained(target_dir)
    eagle_dir = save_eagle(eagle_for(hf), tmp_path / "eagle")
    plain = SpeculativeDecoder(target_dir, method="ar", dtype="float32").generate("w1 w2 w3 w1 w2", 20)
    flat = PassCost((1, 64), (100.0, 100.0))  # a pass costs the same at any width: no measuring in tests
    for options in ({"tree_budget": flat}, {"lookup_branch": 4, "tree_budget": flat}, {"tree": "dynamic:6:3", "tree_budget": "fixed"}):
        dec = SpeculativeDecoder(target_dir, method="eagle", heads=eagle_dir, dtype="float32", **options)
        assert dec.generate("w1 w2 w3 w1 w2", 20).token_ids == plain.token_ids
    with pytest.raises(Refused, match="is an EAGLE drafter: use --method eagle"):
        SpeculativeDecoder(target_dir, method="hydra", heads=eagle_dir, dtype="float32")


def test_a_loaded_bf16_drafter_drafts_in_int4_and_decodes_as_plain_decoding(tmp_path):
    """A drafter loaded for a bf16 target has its linears in int4 wherever speculant's x86 kernel
    runs (bf16 packed elsewhere, see loading.int4_heads): decoding is still plain decoding's."""
    from transformers import AutoModelForCausalLM

    from speculant.api import SpeculativeDecoder
    from speculant.eagle.checkpoint import save_eagle
    from speculant.kernels import x86_kernels
    from speculant.runtime.quant import Int4Linear
    from tiny import tiny_llama, tiny_model_dir

    # hidden size 64: the kernel takes linears of a multiple of 64 inputs and of 16 outputs
    target_dir = tiny_model_dir(tmp_path / "target", base=tiny_llama(0, hidden=64, scale=4.0))
    eagle_dir = save_eagle(eagle_for(AutoModelForCausalLM.from_pretrained(target_dir)), tmp_path / "eagle")
    plain = SpeculativeDecoder(target_dir, method="ar", dtype="bfloat16").generate("w1 w2 w3 w1 w2", 20)
    dec = SpeculativeDecoder(target_dir, method="eagle", heads=eagle_dir, dtype="bfloat16", lookup_branch=4,
                             tree_budget=PassCost((1, 64), (100.0, 100.0)))
    assert dec.generate("w1 w2 w3 w1 w2", 20).token_ids == plain.token_ids
    int4 = [n for n, m in dec.heads.named_modules() if isinstance(m, Int4Linear)]
    if x86_kernels() is None:
        assert not int4
        pytest.skip("no x86 int4 kernel on this machine: the drafter stays bf16")
    # every linear whose shape the kernel takes (the MLP's down projection reads 96 inputs: not a group multiple)
    assert {"fc", "layers.0.self_attn.q_proj", "layers.0.mlp.gate_proj"} <= set(int4), int4
    # q/k/v and gate/up joined into one int4 call each, with the bits of the separate layers
    drafter = dec.heads
    attn, mlp = drafter.layers[0].self_attn, drafter.layers[0].mlp
    assert isinstance(attn.qkv, Int4Linear) and isinstance(mlp.gate_up, Int4Linear)
    u = torch.randn(3, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    fused = (*drafter._qkv(u, torch.arange(5, 8)), mlp(u))
    attn.qkv, mlp.gate_up = None, None
    apart = (*drafter._qkv(u, torch.arange(5, 8)), mlp(u))
    assert all(torch.equal(a, b) for a, b in zip(fused, apart))


def test_training_learns_resumes_and_ships_a_lossless_drafter(target, tmp_path, monkeypatch):
    """On the target's own greedy answers: the features computed once, a few hundred steps lower
    the loss and raise the held-out depth-1 accuracy; a second run over the same directory resumes
    from the last checkpoint; the saved drafter decodes exactly as plain decoding. The loop hands
    the C heap's free pages back every _TRIM_EVERY steps (it grew by GBs on a real corpus)."""
    import speculant.runtime.process as process
    import speculant.training.eagle_train as eagle_train
    from speculant.eagle.checkpoint import load_eagle
    from speculant.training.eagle_train import EagleTrainConfig, compute_features, features_cost, load_features, train_eagle

    backend = HFBackend(target)
    records = greedy_records(backend, 24, 40, V)
    feats_path = compute_features(backend, records, tmp_path / "features", shard_records=10, progress=False)
    feats = load_features(feats_path, records)
    assert feats[0].shape == (sum(len(r["ids"]) for r in records), 64)
    assert sorted(p.name for p in feats_path.iterdir()) == [f"shard-{a:07d}.safetensors" for a in (0, 10, 20)]
    cost = features_cost(feats_path)
    assert cost["shards"] == 3 and cost["seconds"] > 0 and cost["cpu_seconds"] > 0
    model = eagle_for(target, scale=0.05)
    cfg = EagleTrainConfig(steps=150, batch_size=4, seq_len=32, lr=3e-3, warmup=5, held_out=4, eval_depth=3,
                           checkpoint_every=100, token_weight=1.0, precision="float32")
    trims = []
    monkeypatch.setattr(process, "release_memory", lambda: trims.append(1) or True)
    report = train_eagle(model, records, feats, tmp_path / "run", cfg, progress=False)
    assert report["steps"] == 150 and len(report["depth_accuracy"]) == 3
    assert len(trims) == 150 // eagle_train._TRIM_EVERY  # steps 20, 40, ..., 140
    assert report["depth_accuracy"][0] > report["depth_accuracy_before"][0] + 0.2, report
    assert report["depth_accuracy"][0] >= report["depth_accuracy"][1] >= report["depth_accuracy"][2]
    assert len(report["depth_accuracy_train_records"]) == 3
    top4 = report["depth_accuracy_top4"]
    assert len(top4) == 3 and all(a >= b for a, b in zip(top4, report["depth_accuracy"])), report
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-100", "step-150"]
    again = train_eagle(eagle_for(target, scale=0.05), records, feats, tmp_path / "run",
                        EagleTrainConfig(**{**cfg.__dict__, "steps": 160}), progress=False)
    assert again["steps"] == 160 and again["depth_accuracy_before"] is None  # resumed at step 150
    # what the steps took adds up over the runs; one machine, recorded once
    assert 0 < report["train_seconds"] <= again["train_seconds"]
    assert 0 < report["train_cpu_seconds"] <= again["train_cpu_seconds"]
    assert len(again["machines"]) == 1 and again["machines"][0]["cores"] == os.cpu_count()
    step = json.loads((tmp_path / "run" / "checkpoints" / "step-160" / "step.json").read_text())
    assert step["step"] == 160 and step["seconds"] > 0 and step["cpu_seconds"] > 0
    shipped = load_eagle(tmp_path / "run", target)
    prompt = torch.tensor([1, 2, 3, 4, 5, 6])
    plain = decode_to_end(backend, NoDrafter(), prompt, n=30)
    state = decode_to_end(backend, EagleDrafter(shipped, DynamicTree(nodes=8, depth=3), V), prompt, n=30)
    assert state.generated == plain.generated


def test_training_precision_auto_follows_the_cpus_bf16(monkeypatch):
    import speculant.kernels as kernels
    from speculant.errors import ConfigError
    from speculant.training.eagle_train import EagleTrainConfig

    for native, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(kernels, "cpu_has_avx512_bf16", lambda native=native: native)
        assert EagleTrainConfig().precision == want  # the default is "auto", resolved on the spot
        assert EagleTrainConfig(precision="auto").precision == want
        assert EagleTrainConfig(precision="float32").precision == "float32"
        assert EagleTrainConfig(precision="bfloat16").precision == "bfloat16"
    with pytest.raises(ConfigError, match="'auto', 'float32' or 'bfloat16'"):
        EagleTrainConfig(precision="fp16")


def test_held_out_records_are_spread_over_the_corpus():
    from speculant.training.eagle_train import split_records, spread

    assert spread(4272, 16)[:3] == [133, 400, 667] and len(spread(4272, 16)) == 16
    assert spread(24, 4) == [3, 9, 15, 21]
    assert spread(5, 5) == [0, 1, 2, 3, 4] and spread(5, 0) == []
    assert all(len(set(spread(n, k))) == k and max(spread(n, k)) < n for n in range(1, 40) for k in range(1, n + 1))
    held, trained, seen = split_records(40, 4)
    assert held == [5, 15, 25, 35] and sorted(held + trained) == list(range(40))
    assert len(seen) == 4 and set(seen) <= set(trained)
    assert split_records(3, 16)[:2] == ([0, 2], [1])  # at least one record is trained on


def test_features_resume_by_shard_and_refuse_other_records(target, tmp_path):
    """Features are written in shards, each moved in place whole: a second run computes only the
    shards that are missing or were made for other records, and loading features made for other
    records is refused."""
    from speculant.training.eagle_train import compute_features, load_features

    backend = HFBackend(target)
    g = torch.Generator().manual_seed(9)
    records = [{"prompt": "", "prompt_len": 3, "ids": torch.randint(0, V, (5 + i % 4,), generator=g).tolist()}
               for i in range(7)]
    out = compute_features(backend, records, tmp_path / "f", shard_records=3, rows_per_pass=14, progress=False)
    hidden, starts = load_features(out, records)
    shards = sorted(out.iterdir())
    assert [p.name for p in shards] == ["shard-0000000.safetensors", "shard-0000003.safetensors",
                                        "shard-0000006.safetensors"]
    backend.reset()
    alone = backend.forward(torch.tensor(records[4]["ids"]), want_hidden=HiddenNeed.ALL).hidden
    torch.testing.assert_close(hidden[starts[4]:starts[5]], alone.to(torch.bfloat16))
    changed = [dict(r) for r in records]
    changed[4]["ids"] = [1] + changed[4]["ids"][1:] if changed[4]["ids"][0] != 1 else [2] + changed[4]["ids"][1:]
    with pytest.raises(ConfigError, match="shard-0000003.safetensors was computed for other records"):
        load_features(out, changed)
    before = {p.name: p.stat().st_mtime_ns for p in shards}
    shards[2].unlink()
    compute_features(backend, changed, out, shard_records=3, progress=False)
    after = {p.name: p.stat().st_mtime_ns for p in sorted(out.iterdir())}
    assert after["shard-0000000.safetensors"] == before["shard-0000000.safetensors"]  # reused
    assert after["shard-0000003.safetensors"] != before["shard-0000003.safetensors"]  # other records: again
    assert "shard-0000006.safetensors" in after  # missing: made
    h2, s2 = load_features(out, changed)
    assert torch.equal(h2[:starts[3]], hidden[:starts[3]]) and torch.equal(s2, starts)
    # read lazily: a slice across shards, a row, the whole table
    whole = torch.cat([hidden[int(starts[r]):int(starts[r + 1])] for r in range(len(records))])
    assert hidden.shape == whole.shape and torch.equal(hidden[:], whole)
    a, b = int(starts[2]) + 1, int(starts[6]) + 2  # from inside shard 0 to inside shard 2
    assert torch.equal(hidden[a:b], whole[a:b]) and torch.equal(hidden[b], whole[b])
    assert torch.equal(hidden[-1], whole[-1])
    with pytest.raises(ConfigError, match="no features from record 0"):
        load_features(tmp_path / "empty", records)


def test_features_in_batched_passes_equal_one_record_passes(target, tmp_path):
    """The native runtime's feature passes of several records at once give each record the same
    rows as a pass of its own (prompt rows long enough for the prefill kernels included)."""
    from speculant.training.eagle_train import compute_features, load_features

    backend = NativeBackend(NativeModel.from_hf(target.to(torch.bfloat16)))
    g = torch.Generator().manual_seed(4)
    records = [{"prompt": "", "prompt_len": 4, "ids": torch.randint(0, V, (n,), generator=g).tolist()}
               for n in (120, 7, 130, 20, 101)]
    together = load_features(compute_features(backend, records, tmp_path / "a", rows_per_pass=400, progress=False),
                             records)
    alone = load_features(compute_features(backend, records, tmp_path / "b", rows_per_pass=1, progress=False),
                          records)
    assert torch.equal(together[0][:], alone[0][:]) and torch.equal(together[1], alone[1])
    target.to(torch.float32)


def test_training_time_test_steps_are_the_drafting_chain(target):
    """Step s of the unrolled training pass at row p is what drafting computes at depth s after
    committing pairs 0 .. p and drafting the true tokens: the chain of tree_steps on its own
    features."""
    model = eagle_for(target, seed=3, dtype=torch.float64)
    g = torch.Generator().manual_seed(11)
    T, S = 9, 3
    hidden = torch.randn(T, 64, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (T + S - 1,), generator=g)
    feats = model.unrolled(hidden[None], tokens[None], S)
    torch.testing.assert_close(feats[0][0], model(hidden[None], tokens[None, :T])[0], rtol=1e-10, atol=1e-10)
    for p in (0, 4, T - 1):
        cache = EagleCache()
        state = model.extend(cache, hidden[:p + 1], tokens[:p + 1])[-1]  # f^1_p
        torch.testing.assert_close(feats[0][0, p], state, rtol=1e-10, atol=1e-10)
        for s in range(2, S + 1):
            sees = torch.ones(1, cache.staged, dtype=torch.bool) if cache.staged else None
            state = model.tree_step(cache, sees, state[None], tokens[p + s - 1:p + s], torch.tensor([p + s - 1]))[0]
            torch.testing.assert_close(feats[s - 1][0, p], state, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("input_scale", [False, True])
def test_init_for_training_starts_at_the_feature_plus_a_token_term(target, input_scale):
    model = eagle_for(target, seed=1, input_scale=input_scale)
    g = torch.Generator().manual_seed(2)
    unit = torch.ones(64)
    unit[3] = 40.0  # an outlier unit, as real features have
    sample = torch.randn(4000, 64, generator=g) * unit * 3.0
    model.init_for_training(sample, seed=0)
    hidden, tokens = torch.randn(1, 6, 64, generator=g) * unit * 3.0, torch.randint(0, V, (1, 6), generator=g)
    token_term = model(hidden, tokens) - hidden
    e = target.get_input_embeddings().weight[tokens].detach()
    if input_scale:  # the stored scale standardizes both inputs unit by unit
        torch.testing.assert_close(model.input_scale[64:], 1 / sample.pow(2).mean(0).sqrt())
        e = e * model.input_scale[:64]
        assert torch.allclose(model.fc.weight[:, 64:] * model.input_scale[64:], torch.eye(64), atol=1e-5)
    torch.testing.assert_close(token_term, e @ model.fc.weight[:, :64].T, rtol=1e-4, atol=1e-4)
    rms = float(token_term.detach().pow(2).mean().sqrt())
    feature_rms = float(sample.pow(2).mean().sqrt())
    assert feature_rms / 2 < rms < feature_rms * 2, (rms, feature_rms)  # the token counts as much as the feature
