"""A GGUF file of a real model's shape with random weights, to time plain decoding of real-sized
models when the real weights cannot be had here (speed depends on the shapes, not on the values).

    python tools/shape_gguf.py qwen3-4b OUT_DIR        # -> OUT_DIR/qwen3-4b-shape-q4_k_m.gguf
    python tools/shape_gguf.py llama-3.2-3b OUT_DIR

The checkpoint is built with transformers' own config class of the family (the published
hyperparameters below), random bf16 weights (transformers' initialisation, std 0.02) and the
Qwen2.5 tokenizer (the default target's: the only BPE tokenizer of a Llama-3 / Qwen3 size at hand,
151,936 entries; Llama 3.2's own has 128,256, so its output layer is 18% larger here), written as
safetensors, converted by llama.cpp's own ``convert_hf_to_gguf.py`` (bf16) and quantized by its
``llama-quantize`` to Q4_K_M, both from ``make install-llama-server``. Then:

    speculant bench --target OUT_DIR/qwen3-4b-shape-q4_k_m.gguf --methods ar,llama-server ...
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

SHAPES = {
    # Qwen/Qwen3-4B's config.json
    "qwen3-4b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=40960)),
    # meta-llama/Llama-3.2-3B-Instruct's config.json (its vocabulary aside)
    "llama-3.2-3b": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out", help="directory for the files (the checkpoint and the bf16 GGUF are removed at the end)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch
    import transformers
    from transformers import AutoTokenizer

    from speculant.bench.llama_server import llama_server_dir
    from speculant.store.models import resolve

    llama = llama_server_dir()
    convert, quantize = llama / "convert" / "convert_hf_to_gguf.py", llama / "bin" / "llama-quantize"
    if not convert.is_file() or not quantize.is_file():
        print(f"needs llama.cpp's converter and llama-quantize in {llama}: make install-llama-server", file=sys.stderr)
        return 2
    out = Path(args.out)
    final = out / f"{args.shape}-shape-q4_k_m.gguf"
    if final.is_file():
        print(final)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    hf, f16 = out / f"{args.shape}-shape-hf", out / f"{args.shape}-shape-bf16.gguf"
    config_cls, model_cls, shape = SHAPES[args.shape]
    tokenizer = AutoTokenizer.from_pretrained(str(resolve("qwen2.5-coder-1.5b-instruct")))
    if not (hf / "model.safetensors.index.json").is_file() and not (hf / "model.safetensors").is_file():
        cfg = getattr(transformers, config_cls)(vocab_size=151936,  # the tokenizer's model size (Qwen2.5)
                                                bos_token_id=tokenizer.bos_token_id or 151643,
                                                eos_token_id=tokenizer.eos_token_id, **shape)
        torch.manual_seed(args.seed)
        torch.set_default_dtype(torch.bfloat16)
        model = getattr(transformers, model_cls)(cfg)
        torch.set_default_dtype(torch.float32)
        print(f"{args.shape}: {sum(t.numel() for t in model.parameters()) / 1e9:.2f}B parameters", file=sys.stderr)
        model.save_pretrained(str(hf))
        tokenizer.save_pretrained(str(hf))
        del model
    env = {**os.environ, "PYTHONPATH": str(convert.parent / "gguf-py")}
    if not f16.is_file():
        subprocess.run([sys.executable, str(convert), str(hf), "--outtype", "bf16", "--outfile", str(f16)], env=env,
                       check=True)
    tmp = final.with_suffix(".tmp")
    subprocess.run([str(quantize), str(f16), str(tmp), "Q4_K_M", str(os.cpu_count() or 1)],
                   env={**os.environ, "LD_LIBRARY_PATH": str(quantize.parent)}, check=True)
    tmp.replace(final)
    shutil.rmtree(hf)
    f16.unlink()
    print(final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
