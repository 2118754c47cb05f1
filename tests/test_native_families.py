"""The native runtime on the families beyond Llama 2 / Qwen2 (Llama 3.x RoPE scaling and tied
embeddings, YaRN, Qwen3's q/k norms, Mistral, Phi-3's fused projections, Gemma 2's soft-capped
attention and logits, Gemma 3): the logits of the transformers reference, every method's greedy
output equal to plain decoding's, tree passes bit for bit one-token passes in int4/bf16, the int4
form saved and read back, and the limits where the reference would change (a RoPE fixed at its
original context, a sliding window) refused."""

from __future__ import annotations

import pytest
import torch

from speculant.backends.hf import HFBackend
from speculant.backends.native import NativeBackend, NativeModel
from speculant.backends.rope import rope_for
from speculant.drafters.base import NoDrafter
from speculant.errors import ConfigError
from speculant.kernels import x86_kernels
from speculant.trees.buffers import build_tree

from helpers import assert_tree_pass_is_one_token_passes, decode_to_end
from tiny import fixed_prompts, perturbed, tiny_family

V = 64
FAMILIES = ("llama3", "llama-yarn", "qwen3", "mistral", "phi3", "phi3-window", "gemma2", "gemma3")
needs_int4 = pytest.mark.skipif(x86_kernels() is None,
                                reason="needs speculant's int4 kernel (an x86-64 CPU and a C++ toolchain)")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(family):
    return tiny_family(family, seed=0)


def test_rope_is_the_references(family, model):
    """The inverse frequencies and the attention factor are transformers' own for the model (for
    each kind of layer, where they differ: Gemma 3's sliding and full attention)."""
    ref = model.model.rotary_emb
    native = NativeModel.from_hf(model)
    for i, t in enumerate(getattr(model.config, "layer_types", None) or ["full_attention"]):
        inv = getattr(ref, f"{t}_inv_freq", None)
        inv = ref.inv_freq if inv is None else inv
        scale = getattr(ref, f"{t}_attention_scaling", ref.__dict__.get("attention_scaling", 1.0))
        rope = native.ropes[native.layer_rope[i]]
        torch.testing.assert_close(rope.inv_freq, inv.float(), rtol=0, atol=0)
        assert rope.scale == pytest.approx(float(scale))
    if family == "llama3":  # the scaled low frequencies are not plain RoPE's
        plain = 1.0 / 500000.0 ** (torch.arange(0, 16, 2).float() / 16)
        assert not torch.allclose(native.ropes[0].inv_freq, plain)
    if family == "llama-yarn":
        assert native.ropes[0].scale > 1.0
    if family == "gemma3":
        assert len(native.ropes) == 2 and native.windows == [8, 0]
    if family == "gemma2":  # Gemma2Config's default layer types: sliding, full, sliding, ...
        assert len(native.ropes) == 1 and native.windows == [8, 0]
    if family == "phi3-window":
        assert native.windows == [12, 12]


def test_logits_match_the_transformers_reference(model):
    """Prompt, then single steps, then a chain: the logits of the transformers model to 1e-4."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (90,), generator=g)  # past llama3's original context of 64
    hf, nat = HFBackend(model), NativeBackend(model)
    for a, b in ((0, 70), (70, 71), (71, 72), (72, 90)):
        ref = hf.forward(tokens[a:b]).logits
        got = nat.forward(tokens[a:b]).logits
        assert (ref - got).abs().max().item() <= 1e-4


@pytest.mark.parametrize("cap", ["attn_softcap", "final_softcap"])
def test_gemma2_soft_caps_matter(cap):
    """Without either of Gemma 2's soft caps the native logits leave the reference's: the test
    above would see a cap that is not applied (or applied where transformers does not)."""
    import dataclasses

    model = tiny_family("gemma2", seed=0)
    tokens = torch.randint(0, V, (30,), generator=torch.Generator().manual_seed(1))
    ref = HFBackend(model).forward(tokens).logits
    nat = NativeBackend(model)
    assert (ref - nat.forward(tokens).logits).abs().max().item() <= 1e-4
    nat.model.arch = dataclasses.replace(nat.model.arch, **{cap: 0.0})
    nat.reset()
    assert (ref - nat.forward(tokens).logits).abs().max().item() > 1e-2


def test_every_method_greedy_identical_to_plain(model):
    from test_native import drafters

    draft = perturbed(model, noise=0.3)
    backend = NativeBackend(model)
    prompts = fixed_prompts(V)[:3]
    plain = [decode_to_end(backend, NoDrafter(), p, n=24).generated for p in prompts]
    assert plain == [decode_to_end(HFBackend(model), NoDrafter(), p, n=24).generated for p in prompts]
    for name, make in drafters(model, draft).items():
        for p, ref in zip(prompts, plain):
            assert decode_to_end(backend, make(), p, n=24).generated == ref, name


@needs_int4
def test_int4_tree_pass_is_bit_identical_to_one_token_passes(family):
    model = NativeModel.from_hf(tiny_family(family, seed=2, dtype=torch.bfloat16), "int4", quant_head=True,
                                keep_dense=False)
    tree = build_tree("3x2x2x1")
    g = torch.Generator().manual_seed(0)
    context = 40
    ctx = torch.randint(0, V, (context,), generator=g)
    tokens = torch.randint(0, V, (tree.size,), generator=g)
    assert_tree_pass_is_one_token_passes(NativeBackend(model), ctx, tree, tokens)


@needs_int4
@pytest.mark.parametrize("which", ["qwen3", "phi3", "gemma2"])
def test_int4_form_is_saved_and_read_back_bit_identical(tmp_path, monkeypatch, which):
    """From a transformers directory: Qwen3's q/k norms, Phi-3's split projections and Gemma 2's
    sandwich norms survive the saved int4 form."""
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "m"
    tiny_family(which, seed=3, dtype=torch.bfloat16).save_pretrained(src)
    tokens = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(0))
    first = NativeModel.from_dir(src, torch.bfloat16, "int4", quant_head=True)
    monkeypatch.setattr(NativeModel, "_read_dir", lambda *a, **k: pytest.fail("read the dense weights again"))
    second = NativeModel.from_dir(src, torch.bfloat16, "int4", quant_head=True)
    assert torch.equal(NativeBackend(first).forward(tokens).logits, NativeBackend(second).forward(tokens).logits)
    if which == "qwen3":
        assert torch.equal(second.blocks[0].q_norm, first.blocks[0].q_norm)


def test_from_dir_reads_each_family(tmp_path, family, model):
    """A transformers directory of each family (Phi-3's fused weights split as they are read)."""
    model.save_pretrained(tmp_path / "m")
    tokens = torch.randint(0, V, (20,), generator=torch.Generator().manual_seed(4))
    ref = NativeBackend(model).forward(tokens).logits
    got = NativeBackend(NativeModel.from_dir(tmp_path / "m", torch.float32)).forward(tokens).logits
    assert torch.equal(ref, got)


def test_positions_past_what_runs_exactly_are_refused():
    """A RoPE whose frequencies depend on the length (dynamic NTK) limits the context the native
    backend runs as the reference does (plain RoPE up to the original context); past it, a clear
    error."""
    import transformers as tf

    from tiny import tiny_llama

    cfg = tiny_llama().config
    cfg.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    nb = NativeBackend(tf.LlamaForCausalLM(cfg).eval())
    assert nb.model.max_context == 512
    nb.forward(torch.arange(500) % V)
    with pytest.raises(ConfigError, match="original RoPE context"):
        nb.forward(torch.arange(20) % V)


def test_the_decoder_knows_the_native_context_limit_before_it_decodes(tmp_path):
    """With a RoPE the native runtime runs up to its original context only, a prompt past it is
    refused before decoding starts, and a long answer stops at the limit."""
    import transformers as tf

    from speculant import SpeculativeDecoder
    from tiny import tiny_llama, word_tokenizer

    cfg = tiny_llama().config
    cfg.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0,
                           "original_max_position_embeddings": 48}
    assert cfg.max_position_embeddings == 512  # the config's own limit is past the native one
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    word_tokenizer(V).save_pretrained(tmp_path / "m")
    dec = SpeculativeDecoder(str(tmp_path / "m"), method="ar", backend="native", dtype="float32",
                             target_quant="none")
    assert dec.max_length == 48
    with pytest.raises(ConfigError, match="context"):
        dec.generate(list(range(3, 52)), max_new_tokens=4)
    out = dec.generate(list(range(3, 43)), max_new_tokens=30)
    assert len(out.token_ids) <= 8
