"""The native Llama / Qwen2 backend: same logits as the transformers backend on the same weights,
same cache semantics, and every decoding method's greedy output identical to plain decoding on it.

Tolerance: float32 logits of the two backends agree to LOGIT_TOL (absolute; logits of these tiny
models are O(1-10)). They cannot be bit-identical: the two run the same math with different kernels
(e.g. grouped-query attention by reshaping vs by repeating keys).
"""

from __future__ import annotations

import pytest
import torch

from speculant.api import SpeculativeDecoder
from speculant.backends.base import Backend, HiddenNeed
from speculant.backends.hf import HFBackend
from speculant.backends.native import NativeBackend, NativeModel
from speculant.runtime.native_cache import StaticKVCache
from speculant.config import SamplingConfig
from speculant.drafters.base import NoDrafter
from speculant.drafters.draft_model import DraftModelDrafter
from speculant.drafters.lookup import LookupDrafter
from speculant.drafters.medusa import BlockwiseDrafter, MedusaDrafter
from speculant.kernels import x86_kernels
from speculant.errors import ConfigError
from speculant.heads import HeadsConfig, MedusaHeads
from speculant.runtime.quant import Int4Linear, Int8Linear
from speculant.trees.buffers import build_tree, chain

from helpers import assert_tree_pass_is_one_token_passes, decode_to_end
from tiny import perturbed, tiny_llama, tiny_model_dir, tiny_qwen2, fixed_prompts

LOGIT_TOL = 1e-4
GREEDY = SamplingConfig()
V = 64

MODELS = {
    "llama": lambda: tiny_llama(seed=0, scale=4.0),
    "qwen2": lambda: tiny_qwen2(seed=0, scale=4.0),
    "qwen2-tied": lambda: tiny_qwen2(seed=1, tied=True),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def close(a, b, tol=LOGIT_TOL):
    assert a.shape == b.shape
    err = (a - b).abs().max().item()
    assert err <= tol, f"max abs difference {err:.2e} > {tol:.0e}"


def test_protocol(model):
    assert isinstance(NativeBackend(model), Backend)


def test_logits_match_hf(model):
    hf, nat = HFBackend(model), NativeBackend(model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (11,), generator=g)
    # prefill, all rows
    close(hf.forward(prompt).logits, nat.forward(prompt).logits)
    # incremental, one and three tokens, selected rows and hidden states
    step = torch.randint(0, V, (1,), generator=g)
    close(hf.forward(step).logits, nat.forward(step).logits)
    three = torch.randint(0, V, (3,), generator=g)
    a = hf.forward(three, rows=torch.tensor([0, 2]), want_hidden=HiddenNeed.LAST)
    b = nat.forward(three, rows=torch.tensor([0, 2]), want_hidden=HiddenNeed.LAST)
    close(a.logits, b.logits)
    close(a.hidden, b.hidden)
    assert b.logits.dtype == torch.float32 and b.logits.shape == (2, V)
    for be in (hf, nat):  # HiddenNeed.ALL: logits of the rows, hidden states of every new token
        be.rollback(be.cache_length - 3)
    a_all = hf.forward(three, rows=torch.tensor([2]), want_hidden=HiddenNeed.ALL)
    b_all = nat.forward(three, rows=torch.tensor([2]), want_hidden=HiddenNeed.ALL)
    assert a_all.logits.shape == (1, V) and a_all.hidden.shape == b_all.hidden.shape == (3, a.hidden.shape[1])
    close(a_all.hidden, b_all.hidden)
    close(a_all.hidden[[0, 2]], a.hidden)
    close(a_all.logits, a.logits[1:])
    # a tree with explicit positions whose mask window also covers the last 2 cached entries
    tree = build_tree("3x2x1")
    L = nat.cache_length
    assert hf.cache_length == L
    tokens = torch.randint(0, V, (tree.size,), generator=g)
    c = 2
    mask = torch.cat([torch.ones(tree.size, c, dtype=torch.bool), tree.mask], dim=1)
    mask[1:, 1] = False  # all nodes but the root skip cached entry L-1
    positions = L + tree.depths
    close(hf.forward(tokens, positions, mask).logits, nat.forward(tokens, positions, mask).logits)
    assert nat.cache_length == L + tree.size


def test_from_dir_equals_from_hf(tmp_path):
    path = tiny_model_dir(tmp_path / "m", seed=2)
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(path).eval()
    a, b = NativeBackend(NativeModel.from_hf(hf_model)), NativeBackend(NativeModel.from_dir(path, torch.float32))
    ids = torch.arange(1, 12)
    assert torch.equal(a.forward(ids).logits, b.forward(ids).logits)


def test_weights_are_shared_not_copied(model):
    nat = NativeModel.from_hf(model)
    assert nat.embed.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert nat.blocks[0].q_proj.weight.data_ptr() == model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    assert nat.lm_head.weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()


def test_cache_rollback_and_compact_semantics():
    cache = StaticKVCache(2, 1, 2, torch.float32, capacity=4)
    for step in range(3):  # 9 entries: grows past the capacity twice
        k = torch.arange(3 * step, 3 * step + 3, dtype=torch.float32).view(1, 3, 1).expand(1, 3, 2)
        cache.reserve(cache.length + 3)
        for layer in range(2):
            cache.write(layer, k + 100 * layer, -k, cache.length)
        cache.advance(3)
    assert cache.length == 9 and cache.capacity >= 9
    assert cache.kv[1, 0, 0, :9, 0].tolist() == [100.0 + i for i in range(9)]
    cache.compact(4, torch.tensor([0, 2, 3]))  # entries 4, 6, 7 -> 4, 5, 6
    assert cache.length == 7
    assert cache.kv[0, 0, 0, :7, 0].tolist() == [0, 1, 2, 3, 4, 6, 7]
    assert cache.kv[0, 1, 0, :7, 1].tolist() == [0, -1, -2, -3, -4, -6, -7]
    cache.rollback(5)
    assert cache.length == 5
    with pytest.raises(ValueError):
        cache.rollback(6)


def test_rollback_and_compact_match_hf(model):
    """After a tree pass, compaction of a side branch, and a rollback, the next logits agree."""
    hf, nat = HFBackend(model), NativeBackend(model)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (7,), generator=g)
    tree = build_tree("2x2x1")  # nodes: root, 2 at depth 1, 4 at depth 2, 4 at depth 3
    tokens = torch.randint(0, V, (tree.size,), generator=g)
    keep = torch.tensor([0, 2, 5])  # root -> second child -> one of its children
    assert tree.parents[5] == 2 and tree.parents[2] == 0
    for b in (hf, nat):
        b.forward(prompt)
        L = b.cache_length
        b.forward(tokens, L + tree.depths, tree.mask)
        b.compact(L, keep)
        assert b.cache_length == L + 3
    nxt = torch.randint(0, V, (2,), generator=g)
    after = nat.forward(nxt).logits
    close(hf.forward(nxt).logits, after)
    # the compacted cache equals feeding the accepted path sequentially
    seq = NativeBackend(model)
    seq.forward(torch.cat([prompt, tokens[keep]]))
    close(seq.forward(nxt).logits, after)
    for b in (hf, nat):
        b.rollback(5)
    close(hf.forward(nxt).logits, nat.forward(nxt).logits)


def test_tree_verification_equals_sequential(model):
    nat = NativeBackend(model)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, V, (6,), generator=g)
    tree = build_tree("3x2x1")
    tokens = torch.randint(0, V, (tree.size,), generator=g)
    nat.forward(prompt)
    tree_logits = nat.forward(tokens, 6 + tree.depths, tree.mask).logits
    for node in range(tree.size):
        path = [node]
        while path[-1] != 0:
            path.append(int(tree.parents[path[-1]]))
        seq = NativeBackend(model)
        out = seq.forward(torch.cat([prompt, tokens[list(reversed(path))]]), rows=torch.tensor([5 + len(path)]))
        close(out.logits, tree_logits[node:node + 1])


# ------------------------------------------------------------------ every method, greedy


def prompts():
    return fixed_prompts(V)


def random_heads(hidden, lm_head=None):
    """3 heads with random blocks; with ``lm_head``, projecting through it (shared), else their own."""
    heads = MedusaHeads(HeadsConfig(3, 1, hidden, V, shared_lm_head=lm_head is not None), lm_head)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return heads.eval()


def drafters(target_model, draft_model):
    hidden = target_model.config.hidden_size
    heads = random_heads(hidden)
    return {
        "sd": lambda: DraftModelDrafter(NativeBackend(draft_model), chain(3), GREEDY, V),
        "sd-self": lambda: DraftModelDrafter(NativeBackend(target_model), chain(4), GREEDY, V),
        "mcsd": lambda: DraftModelDrafter(NativeBackend(draft_model), build_tree("3x2x1"), GREEDY, V),
        "lookup": lambda: LookupDrafter(3),
        "medusa": lambda: MedusaDrafter(heads, build_tree("[[0],[1],[0,0],[0,1]]"), V),
        "bpd": lambda: BlockwiseDrafter(heads, V, 2),
    }


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_every_method_greedy_identical(which):
    target = MODELS[which]()
    draft = perturbed(target, noise=0.3)
    backend = NativeBackend(target)
    plain = [decode_to_end(backend, NoDrafter(), p, n=30).generated for p in prompts()]
    # the native plain output is the transformers backend's plain output (fp32)
    assert plain == [decode_to_end(HFBackend(target), NoDrafter(), p, n=30).generated for p in prompts()]
    for name, make in drafters(target, draft).items():
        for p, ref in zip(prompts(), plain):
            state = decode_to_end(backend, make(), p, n=30)
            assert state.generated == ref, name
            if name == "sd-self":
                assert state.stats.tokens_per_call > 3


# ------------------------------------------------------------------ quantized

def test_dequantized_large_inputs_match_kernel():
    """Without a dense weight, inputs of > max_kernel_rows rows use the dequantized weight: the
    same quantized weights as the kernel, up to rounding."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 192).to(torch.bfloat16)
    for q in (Int8Linear(lin, keep_dense=False), Int4Linear(lin, keep_dense=False)):
        assert q.weight is None
        if getattr(q, "kind", "torch") != "torch":  # speculant's int4 kernels take any width, row-invariant
            x = torch.randn(300, 128, dtype=torch.bfloat16)
            assert torch.equal(q(x), torch.cat([q(x[i:i + 4]) for i in range(0, 300, 4)]))
            continue
        x = torch.randn(q.max_kernel_rows + 8, 128, dtype=torch.bfloat16)
        big = q(x).float()  # dequantized path
        small = torch.cat([q(x[i:i + 4]) for i in range(0, x.shape[0], 4)]).float()  # kernel
        assert (big - small).abs().max().item() <= 0.05 * small.abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("quant,dtype,isa", [("int8", torch.float32, ""), ("int8", torch.bfloat16, ""),
                                             ("int4", torch.bfloat16, ""), ("int4", torch.bfloat16, "portable")])
def test_quantized_native_sd_equals_ar(quant, dtype, isa, monkeypatch):
    """isa "portable": int4_x86.cpp's portable C++ path, forced as a user would (SPECULANT_INT4_ISA)."""
    if isa and x86_kernels() is None:
        pytest.skip("needs speculant's x86 kernels (an x86-64 CPU and a C++ toolchain)")
    if isa:
        monkeypatch.setenv("SPECULANT_INT4_ISA", isa)
    target = tiny_qwen2(seed=0, scale=4.0, dtype=dtype)
    backend = NativeBackend(NativeModel.from_hf(target, quant, quant_head=True, keep_dense=False))
    assert isinstance(backend.model.blocks[0].q_proj, Int8Linear if quant == "int8" else Int4Linear)
    if quant == "int4" and x86_kernels() is not None:  # speculant's, not PyTorch's
        assert backend.model.blocks[0].q_proj.kind == "x86"
        assert backend.model.blocks[0].qkv is not None  # q, k, v joined into one call
    if isa:
        assert backend.model.blocks[0].q_proj._isa == isa
    draft = NativeBackend(perturbed(target, noise=0.3))
    # heads sharing the quantized output layer (no dense weight: called as a module)
    shared = random_heads(64, backend.model.get_output_embeddings()).to(dtype)
    for p in prompts():
        plain = decode_to_end(backend, NoDrafter(), p, n=30).generated
        assert len(plain) == 30
        for drafter in (DraftModelDrafter(draft, chain(3), GREEDY, V), LookupDrafter(3),
                        DraftModelDrafter(draft, build_tree("2x2"), GREEDY, V),
                        DraftModelDrafter(draft, build_tree("4x2x2"), GREEDY, V),  # 29 rows: > 16
                        MedusaDrafter(shared, build_tree("3x2x1"), V, LookupDrafter(4))):
            assert decode_to_end(backend, drafter, p, n=30).generated == plain


def test_api_native_backend(tmp_path):
    tdir = tiny_model_dir(tmp_path / "t", seed=0)
    from transformers import AutoModelForCausalLM

    ddir = tmp_path / "d"
    tiny_model_dir(ddir, base=AutoModelForCausalLM.from_pretrained(tdir), noise=0.3, seed=4)
    kw = dict(dtype="float32", draft_quant="none")
    hf = SpeculativeDecoder(str(tdir), method="ar", **kw).generate("w1 w2 w3", 20)
    for method in ("ar", "sd", "mcsd", "lookup"):
        dec = SpeculativeDecoder(str(tdir), str(ddir) if method in ("sd", "mcsd") else None, method=method,
                                 backend="native", tree="2x1", **kw)
        assert isinstance(dec.target_backend, NativeBackend)
        assert dec.generate("w1 w2 w3", 20).token_ids == hf.token_ids, method
    q = SpeculativeDecoder(str(tdir), method="ar", backend="native", target_quant="int8", **kw)
    assert q.target.model.blocks[0].q_proj.weight is None  # the quantized target keeps no dense copy
    assert len(q.generate("w1 w2 w3", 10).token_ids) == 10
    with pytest.raises(ConfigError, match="native"):
        SpeculativeDecoder(str(tdir), method="ar", target_quant="int8", **kw)
    with pytest.raises(ConfigError, match="backend"):
        SpeculativeDecoder(str(tdir), method="ar", backend="onnx", **kw)


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ConfigError, match="native backend"):
        NativeBackend(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=V)))


@pytest.mark.real
def test_real_smollm2_fp32_matches_hf():
    from speculant.store.models import load

    lm = load("smollm2-135m-instruct", "float32")
    hf, nat = HFBackend(lm.model), NativeBackend(lm.model)
    ids = lm.tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                       return_tensors="pt").input_ids[0]
    with torch.inference_mode():
        close(hf.forward(ids).logits, nat.forward(ids).logits, tol=2e-3)
        tree = build_tree("3x2x1")
        tokens = torch.randint(0, 49152, (tree.size,), generator=torch.Generator().manual_seed(0))
        L = hf.cache_length
        close(hf.forward(tokens, L + tree.depths, tree.mask).logits,
              nat.forward(tokens, L + tree.depths, tree.mask).logits, tol=2e-3)


def test_quality_scoring_on_tiny_model():
    """quant-eval's pieces: a model agrees with its own greedy output at every position, and the
    first difference found by scoring is where its quantized copy's greedy decoding departs."""
    from speculant.bench.quality import greedy, perplexity, teacher_forced

    target = tiny_qwen2(seed=0, scale=4.0)
    backend = NativeBackend(target)
    prompt = prompts()[0]
    ref = greedy(backend, prompt, 20, set())
    assert teacher_forced(backend, prompt, ref) == (20, 20, 20)
    q = NativeBackend(NativeModel.from_hf(target, "int8", quant_head=True, keep_dense=False))
    same, n, first = teacher_forced(q, prompt, ref)
    assert greedy(q, prompt, 20, set())[:first] == ref[:first]
    ppl = perplexity(backend, torch.arange(40) % V)
    assert 1.0 < ppl < 10 * V


@pytest.mark.skipif(x86_kernels() is None, reason="needs speculant's int4 kernel (an x86-64 CPU and a C++ toolchain)")
@pytest.mark.parametrize("isa", ["", "portable"])  # "": the best this CPU has; portable: forced (SPECULANT_INT4_ISA)
@pytest.mark.parametrize("own_attention", [True, False])  # False: PyTorch's fused attention, padded calls
@pytest.mark.parametrize("context", [3, 40, 509])  # 509 + tree: the keys cross a 512 padding block
def test_int4_tree_verification_is_bit_identical_to_one_token_passes(context, own_attention, isa, monkeypatch):
    """With the int4 kernel (row-independent) and row-invariant attention (speculant's kernel, or
    PyTorch's in padded calls), every node of a tree pass gets exactly the logits a one-token pass
    over its own path gives: bf16/int4 speculative decoding reproduces plain decoding bit for bit,
    not just in float32."""
    if isa:
        if x86_kernels() is None:
            pytest.skip("needs speculant's x86 kernels")
        monkeypatch.setenv("SPECULANT_INT4_ISA", isa)
    model = NativeModel.from_hf(tiny_qwen2(seed=2, dtype=torch.bfloat16), "int4", quant_head=True, keep_dense=False)
    if not own_attention:
        import speculant.backends.native as native
        monkeypatch.setattr(native, "cpu_kernels", lambda: None)
        monkeypatch.setattr(native, "x86_kernels", lambda: None)
    tree = build_tree("3x2x2x1")  # 3 + 6 + 12 + 12 = 33 nodes + root: several attention calls
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, V, (context,), generator=g)
    tokens = torch.randint(0, V, (tree.size,), generator=g)
    assert_tree_pass_is_one_token_passes(NativeBackend(model), ctx, tree, tokens)


@pytest.mark.skipif(x86_kernels() is None, reason="needs speculant's int4 kernel (an x86-64 CPU and a C++ toolchain)")
@pytest.mark.parametrize("tied", [False, True])
def test_int4_model_is_saved_once_and_read_back_bit_identical(tmp_path, monkeypatch, tied):
    """The first int4 load of a directory quantizes and saves it; later loads read the saved file
    (no dense weights read) and give the same logits bit for bit; a damaged file is rebuilt; a
    file of the former AMX layout is left alone (an x86 one is made beside it)."""
    from speculant.backends import native_store

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "m"
    tiny_qwen2(seed=3, tied=tied, dtype=torch.bfloat16).save_pretrained(src)
    tokens = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(0))

    def logits(model):
        return NativeBackend(model).forward(tokens).logits

    # a file of the former AMX layout, as earlier versions saved on AMX CPUs: never read nor replaced
    former = native_store.store_path(src, sorted(src.glob("*.safetensors")), True, "amx", 64)
    former.parent.mkdir(parents=True)
    former.write_bytes(b"the former layout")
    first = logits(NativeModel.from_dir(src, torch.bfloat16, "int4", quant_head=True))
    saved = [f for f in (tmp_path / "cache" / "native").glob("*.safetensors") if f != former]
    assert len(saved) == 1 and "-int4-x86-g64-" in saved[0].name and saved[0].name.endswith("-head-v1.safetensors")
    assert former.read_bytes() == b"the former layout"
    monkeypatch.setattr(NativeModel, "_read_dir", lambda *a, **k: pytest.fail("read the dense weights again"))
    second = NativeModel.from_dir(src, torch.bfloat16, "int4", quant_head=True)
    assert torch.equal(first, logits(second))
    assert second.blocks[0].qkv is not None and second.blocks[0].q_proj.qweight.data_ptr() == \
        second.blocks[0].qkv.qweight.data_ptr()  # the parts are views of the joined layer
    monkeypatch.undo()
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    del second  # it maps the file: replace the file (a new inode), as every writer here does
    damaged = saved[0].with_name("damaged")
    damaged.write_bytes(b"not a safetensors file")
    damaged.replace(saved[0])
    third = NativeModel.from_dir(src, torch.bfloat16, "int4", quant_head=True)
    assert torch.equal(first, logits(third))
    assert native_store.load_store(saved[0], third.config, None, torch.bfloat16) is not None  # rewritten


def _int4_tiny(seed=0):
    return NativeModel.from_hf(tiny_qwen2(seed=seed, scale=4.0, dtype=torch.bfloat16), "int4", quant_head=True,
                               keep_dense=False)


@pytest.mark.skipif(x86_kernels() is None, reason="needs speculant's int4 kernel (an x86-64 CPU and a C++ toolchain)")
def test_long_prompts_take_the_prefill_kernels_and_every_method_still_equals_plain(monkeypatch):
    """A prompt of PREFILL_MIN_ROWS tokens or more is prefilled by the prefill kernels (on AMX the
    int4 weights widened to bf16, int4_prefill_amx.cpp; flash attention): plain and speculative
    decoding share that prefill, so greedy outputs stay identical. Its logits are the decoding
    kernels' up to rounding. SPECULANT_EXACT_PREFILL=1 keeps prompts on the decoding kernels, and
    a shorter prompt never leaves them."""
    import speculant.backends.native as native
    from speculant.backends.base import ForwardRequest, forward_batch

    target = tiny_qwen2(seed=0, scale=4.0, dtype=torch.bfloat16)
    backend = NativeBackend(NativeModel.from_hf(target, "int4", quant_head=True, keep_dense=False))
    widths, plans = [], []
    layer_prefill, plan = Int4Linear.forward_prefill, NativeBackend._attention_plan
    monkeypatch.setattr(Int4Linear, "forward_prefill", lambda self, x: widths.append(x.shape[0]) or layer_prefill(self, x))
    monkeypatch.setattr(NativeBackend, "_attention_plan",
                        lambda self, n, past, mask, g, prefill=False, *rest: plans.append(prefill) or
                        plan(self, n, past, mask, g, prefill, *rest))
    g = torch.Generator().manual_seed(7)
    rep = torch.randint(0, V, (12,), generator=g)
    prompt = torch.cat([torch.randint(0, V, (native.PREFILL_MIN_ROWS,), generator=g), rep, rep])
    plain = decode_to_end(backend, NoDrafter(), prompt, n=30).generated
    assert len(widths) == 4 * 2 and set(widths) == {prompt.shape[0] - 1}  # qkv, o, gate_up, down of both layers
    assert plans.count(True) == 1  # the prefill pass only; every decoding pass is row-invariant
    draft = NativeBackend(perturbed(target, noise=0.3))
    shared = random_heads(64, backend.model.get_output_embeddings()).to(torch.bfloat16)
    for drafter in (LookupDrafter(3), DraftModelDrafter(draft, chain(3), GREEDY, V),
                    MedusaDrafter(shared, build_tree("3x2x1"), V, LookupDrafter(4))):
        assert decode_to_end(backend, drafter, prompt, n=30).generated == plain

    rows = torch.tensor([prompt.shape[0] - 1])
    backend.reset()
    fast = forward_batch([backend], [ForwardRequest(prompt, rows=rows, prefill=True)])[0].logits
    backend.reset()
    exact = backend.forward(prompt, rows=rows).logits
    assert (fast - exact).abs().max() <= 0.05 * exact.abs().max()

    widths.clear()
    monkeypatch.setenv("SPECULANT_EXACT_PREFILL", "1")
    decode_to_end(backend, NoDrafter(), prompt, n=3)
    monkeypatch.delenv("SPECULANT_EXACT_PREFILL")
    decode_to_end(backend, NoDrafter(), prompt[:native.PREFILL_MIN_ROWS], n=3)  # prefills PREFILL_MIN_ROWS - 1
    assert widths == []


@pytest.mark.skipif(x86_kernels() is None, reason="needs speculant's int4 kernel (an x86-64 CPU and a C++ toolchain)")
def test_a_prompt_prefilled_beside_other_sequences_gets_what_it_gets_alone():
    """One pass of a long prompt (prefill kernels), a short prompt and a tree verification of a
    third sequence: each sequence's logits and KV cache are bit for bit those of its own pass (the
    prefill kernels take exactly the long prompt's rows)."""
    from speculant.backends.base import ForwardRequest, forward_batch
    from speculant.backends.native import PREFILL_MIN_ROWS

    model = _int4_tiny(seed=4)
    g = torch.Generator().manual_seed(1)
    tree = build_tree("3x2x1")
    requests = [ForwardRequest(torch.randint(0, V, (PREFILL_MIN_ROWS + 17,), generator=g), prefill=True),
                ForwardRequest(torch.randint(0, V, (20,), generator=g), prefill=True),
                ForwardRequest(torch.randint(0, V, (tree.size,), generator=g), 9 + tree.depths, tree.mask)]
    context = torch.randint(0, V, (9,), generator=g)

    def fresh():
        backends = [NativeBackend(model) for _ in requests]
        backends[2].forward(context, rows=torch.empty(0, dtype=torch.long))
        return backends

    alone_backends, together_backends = fresh(), fresh()
    alone = [forward_batch([b], [r])[0] for b, r in zip(alone_backends, requests)]
    together = forward_batch(together_backends, requests)
    for a, t, ba, bt in zip(alone, together, alone_backends, together_backends):
        assert torch.equal(a.logits, t.logits)
        assert ba.cache.length == bt.cache.length and torch.equal(ba.cache.kv[:, :, :, :ba.cache.length],
                                                                  bt.cache.kv[:, :, :, :bt.cache.length])
