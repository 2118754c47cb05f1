"""Tiny randomly initialised models for fast end-to-end tests."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int = 0, vocab: int = 64, hidden: int = 48, layers: int = 2, scale: float = 1.0):
    """A 2-layer Llama with random weights (fp32). ``scale`` sharpens its distributions."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def perturbed(model, noise: float, seed: int = 1):
    """A copy of ``model`` with Gaussian noise on every weight: a draft that mostly agrees."""
    torch.manual_seed(seed)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(noise * p.std() * torch.randn_like(p))
    return other


def word_tokenizer(vocab: int = 64):
    """An offline word-level tokenizer: tokens w0 .. w{vocab-4} plus <unk>, <s>, </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_model_dir(path, seed: int = 0, vocab: int = 64, noise: float = 0.0, base=None):
    """Save a tiny Llama (or a perturbed copy of ``base``) and a word tokenizer to ``path``."""
    model = perturbed(base, noise, seed) if base is not None else tiny_llama(seed, vocab=vocab, scale=4.0)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    word_tokenizer(vocab).save_pretrained(path)
    return path


def tiny_pair(root, noise: float = 0.3) -> dict:
    """A tiny target (seed 0) and a draft that is the target perturbed by ``noise`` (it agrees with
    the target often), saved under ``root``: {"target", "draft", "root"} (the directories as str)."""
    target = tiny_model_dir(root / "target", seed=0)
    draft = tiny_model_dir(root / "draft", seed=1, base=tiny_llama(0, scale=4.0), noise=noise)
    return {"target": str(target), "draft": str(draft), "root": root}


def tiny_qwen2(seed: int = 0, vocab: int = 64, hidden: int = 64, layers: int = 2, scale: float = 1.0,
               tied: bool = False, dtype: torch.dtype = torch.float32):
    """A 2-layer Qwen2 with random weights: q/k/v biases (made nonzero), GQA (4 query heads per
    kv head pair), rope_theta 1e6 as in Qwen2.5. ``tied``: output layer = embedding matrix."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
        if not tied:
            model.lm_head.weight.mul_(scale)
    return model.to(dtype)


def lora_adapter(model_dir, out, dtype: torch.dtype = torch.float32, r: int = 4, std: float = 0.3, seed: int = 0):
    """A LoRA adapter on every linear layer but the output layer of the model in ``model_dir``,
    with random, non-zero A and B (peft starts B at zero, which adapts nothing), saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(std * torch.randn(p.shape, generator=g))
    peft_model.save_pretrained(str(out))
    return out


def fixed_prompts(vocab: int = 64) -> list[torch.Tensor]:
    """Three fixed prompts: random tokens, a repetitive one (something for the n-gram drafter to
    find), and a single token (no prefill)."""
    g = torch.Generator().manual_seed(3)
    rep = torch.randint(0, vocab, (6,), generator=g).repeat(3)
    return [torch.randint(0, vocab, (9,), generator=g), rep, torch.tensor([5])]


def tiny_family(family: str, seed: int = 0, vocab: int = 64, hidden: int = 64, layers: int = 2, scale: float = 4.0,
                dtype: torch.dtype = torch.float32):
    """A 2-layer model of one of the families the native runtime runs besides Llama 2 / Qwen2, with
    random weights, in the features that family adds:

    - ``llama3``: Llama 3.x RoPE scaling (rope_type llama3, factor 8, original context 64, so the
      scaled low frequencies matter at test lengths) and tied embeddings (Llama 3.2 1B / 3B);
    - ``llama-yarn``: YaRN RoPE scaling (factor 4 over an original context of 128);
    - ``qwen3``: per-head q/k RMSNorm (its weights made non-trivial), head_dim 32 independent of
      hidden / heads;
    - ``mistral``: a Mistral with a sliding window (4096: wider than any test);
    - ``phi3``: Phi-3's fused qkv_proj and gate_up_proj;
    - ``phi3-window``: a Phi-3 with a sliding window of 12 (shorter than the tests' sequences);
    - ``gemma3``: a Gemma 3 text model: a sliding layer (window 8) and a global one with their own
      RoPE bases, (1 + w) norms (made non-trivial), sandwich norms, q/k norms, GELU-tanh, scaled
      embeddings, query_pre_attn_scalar 32 (not head_dim 16), tied embeddings;
    - ``gemma2``: a Gemma 2: Gemma2Config's own alternation of layer types (sliding first, window 8),
      (1 + w) norms (made non-trivial), sandwich norms, no q/k norms, query_pre_attn_scalar 24 (not
      head_dim 16), attention scores soft-capped at 5 and logits at 3, the q/k projections (x 4
      each) and the untied output layer (x 4) large enough that both caps bite."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if family == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=True))
    elif family == "llama-yarn":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False))
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=4096, tie_word_embeddings=False))
    elif family in ("phi3", "phi3-window"):
        window = 12 if family == "phi3-window" else None
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**common, pad_token_id=0, sliding_window=window,
                                                 tie_word_embeddings=False))
    elif family == "gemma3":
        cfg = tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=8, query_pre_attn_scalar=32,
                                  layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True)
        model = tf.Gemma3ForCausalLM(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(-0.5, 0.5)
    elif family == "gemma2":
        cfg = tf.Gemma2Config(**common, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=False)
        model = tf.Gemma2ForCausalLM(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(-0.5, 0.5)
                elif "q_proj" in name or "k_proj" in name:
                    p.mul_(4.0)
    else:
        raise ValueError(family)
    model = model.float().eval()
    if not model.config.tie_word_embeddings:
        with torch.no_grad():
            model.lm_head.weight.mul_(scale)
    return model.to(dtype)


def llama_gguf_writer(path, name: str, vocab: int, hidden: int, layers: int, heads: int, kv: int, ffn: int):
    """A ``gguf.GGUFWriter`` at ``path`` with a tiny Llama's header written (its shape, a
    SentencePiece-style vocabulary of ``vocab`` tokens: <unk> <s> </s>, a..z, t<i>); the caller adds
    the tensors and writes the file."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    tokens = ["<unk>", "<s>", "</s>"] + [chr(ord("a") + i) for i in range(26)]
    tokens += [f"t{i}" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [1] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    return w
