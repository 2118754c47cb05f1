"""Which numerics give llama-server's greedy text on the same Q4_K_M GGUF: a float-level emulation.

On 16 held-out chat prompts (turn 1 of the last two MT-bench questions of each of its eight
categories, ids 89-90, 99-100, ..., 159-160: ``speculant bench`` takes the first questions of its
mt_bench group only), in the model's chat template as the bench builds them, this counts how many
96-token greedy continuations equal llama-server's token for token, under:

- ``A``  speculant's own runtime on the file's blocks (``target_quant="gguf"``, ``method="ar"``):
         a real greedy generation;
- ``B``  float32, the GGUF's weights de-quantized by the ``gguf`` package, no activation rounding;
- ``C``  B + every linear layer's input rounded as llama.cpp's CPU path does for its weight type
         (all weights of this file are Q4_K or Q6_K: Q8_K, blocks of 256 values, d = amax / 127,
         int8 codes rounded to nearest-even; the output layer's input too);
- ``D``  C + the KV cache rounded to float16 (K after RoPE), llama.cpp's default cache type;
- ``E``  D + llama.cpp's CPU flash attention where it takes its one-row kernel, i.e. for every
         generated token and for prompts under 64 tokens (the query rounded to float16, the
         weighted sum of V kept in a float16 accumulator that is rounded after every key; for a
         generated token the keys split in one chunk per thread once the padded cache view
         reaches 512 cells; prompts of 64 tokens or more take its tiled kernel, float32 throughout
         over the float16 cache, as in D), RoPE's angles
         as ggml computes them (theta multiplied by theta_scale pair after pair, in float32) and
         RMSNorm's sum of squares in double;

and ablations of E that put back one of speculant's choices each: no activation rounding
(``E-noact``), speculant's activation rounding (bf16 input, int8 per 32 for Q4_K and per 16 for
Q6_K: ``E-specact``), a bf16 residual stream (``E-bf16res``), a bf16 KV cache (``E-bf16kv``), and
E without the decode attention or without the RoPE/RMSNorm details (``E-noFA``, ``E-norope``);
``S`` emulates speculant's runtime (bf16 residual stream, its activation rounding, bf16 KV cache),
to check the emulation against A's real counts; ``E-f64dot`` is E with each linear layer's sums in
float64 (closer to llama.cpp's exact integer sums per block), so E against E-f64dot shows how much
the order of float32 sums alone moves the text.

Two more rows run llama-server itself with one setting changed, to see how often llama.cpp agrees
with itself: ``L-norepack`` (``--no-repack``: Q4_K through ggml's plain Q4_K x Q8_K dot product
instead of its repacked 8x8 kernel; the same Q8_K activations, another order of float sums) and
``L-fa-off`` (``-fa off``: attention without flash attention).

llama-server (``$SPECULANT_CACHE/peers/llama.cpp-0.3.36``) runs as ``speculant bench`` starts it
(``bench.llama_server.LlamaServer``: one slot, temperature 0, top-k 1, no penalties, the prompt as
token ids, ``n_predict`` 96, no speculation, flash attention "auto", which resolves to on for the
CPU), once as the bench asks and once more with ``n_probs`` 5 for the log-probabilities (the two
token lists must agree). Generation stops only at 96 tokens or an end-of-generation token on both
sides (no stop strings).

The emulated configurations are teacher-forced: one pass over the prompt and llama-server's tokens
gives every position's logits, and a greedy continuation equals llama-server's up to the first
position where the argmax differs, so "same text" is "no position differs"; every row is computed
on its own (per-row rounding), so the rows of generated tokens get what llama.cpp's one-token
steps compute, up to the order of float32 sums. At the first difference
the JSON keeps both sides' top log-probabilities; a near-tie is a first difference where
llama-server's own log-probability of the emulation's token is within ``--near-tie`` (0.1) nats of
its top token's.

    python tools/llama_numerics.py --out FILE.json       # everything (about 1.5 h on 2 cores, peak ~8 GB)
    python tools/llama_numerics.py --configs A,B,C,D,L-norepack --out FILE.json

``--work`` keeps each stage's results (llama-server's tokens, A's tokens), so a rerun with other
``--configs`` reuses them. The emulation loads the GGUF de-quantized to float32 (~7 GB).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

TARGET = "qwen2.5-coder-1.5b-instruct"
QUESTION_IDS = (89, 90, 99, 100, 109, 110, 119, 120, 129, 130, 139, 140, 149, 150, 159, 160)
N_PROBS = 5
UBATCH = 512  # llama-server's default n_ubatch: rows per prompt batch
FA_TILE_Q = 64  # ggml's GGML_FA_TILE_Q: batches of fewer rows take flash attention's one-row kernel

# what each emulated configuration rounds (see the module docstring)
BASE = dict(act="none", dot="f32", kv="f32", decode_attn="f32", resid="f32", ggml_rope=False, ggml_norm=False)
CONFIGS = {
    "B": {},
    "C": dict(act="q8k"),
    "D": dict(act="q8k", kv="f16"),
    "E": dict(act="q8k", kv="f16", decode_attn="ggml", ggml_rope=True, ggml_norm=True),
    "E-f64dot": dict(act="q8k", dot="f64", kv="f16", decode_attn="ggml", ggml_rope=True, ggml_norm=True),
    "E-noact": dict(act="none", kv="f16", decode_attn="ggml", ggml_rope=True, ggml_norm=True),
    "E-specact": dict(act="spec", kv="f16", decode_attn="ggml", ggml_rope=True, ggml_norm=True),
    "E-bf16res": dict(act="q8k", kv="f16", decode_attn="ggml", ggml_rope=True, ggml_norm=True, resid="bf16"),
    "E-bf16kv": dict(act="q8k", kv="bf16", decode_attn="ggml", ggml_rope=True, ggml_norm=True),
    "E-noFA": dict(act="q8k", kv="f16", ggml_rope=True, ggml_norm=True),
    "E-norope": dict(act="q8k", kv="f16", decode_attn="ggml"),
    "S": dict(act="spec", kv="bf16", resid="bf16"),
}
# llama-server itself with another setting: how often llama.cpp agrees with itself
VARIANTS = {"L-norepack": ("--no-repack",), "L-fa-off": ("-fa", "off")}
ORDER = ("A",) + tuple(CONFIGS) + tuple(VARIANTS)


# ------------------------------------------------------------------------------------------------
# prompts
# ------------------------------------------------------------------------------------------------

def held_out_prompts(tokenizer) -> list[dict]:
    """The 16 prompts: token ids as ``speculant bench`` builds them (chat template, no special tokens added)."""
    from speculant.specbench import load_questions
    from speculant.store.chat import chat_prompt

    by_id = {q["question_id"]: q for q in load_questions()}
    out = []
    for qid in QUESTION_IDS:
        q = by_id[qid]
        ids = tokenizer(chat_prompt(tokenizer, q["turns"][0]), add_special_tokens=False).input_ids
        out.append({"question_id": qid, "category": q["category"], "ids": [int(t) for t in ids]})
    return out


def tokenizer():
    from transformers import AutoTokenizer
    from speculant.store.models import resolve

    return AutoTokenizer.from_pretrained(str(resolve(TARGET)))


# ------------------------------------------------------------------------------------------------
# stage: llama-server
# ------------------------------------------------------------------------------------------------

def run_llama(prompts: list[dict], max_new: int, threads: int, extra_args: tuple[str, ...] = (),
              probs: bool = True) -> dict:
    import urllib.request

    from speculant.bench.llama_server import _HTTP, LlamaServer

    rows = []
    with LlamaServer("plain", TARGET, n_threads=threads, extra_args=extra_args) as server:
        args = server.args(server.port)
        for p in prompts:
            ids = torch.tensor(p["ids"])
            tokens, _, timing = server.run(ids, max_new)  # exactly the bench's request
            if not probs:
                rows.append({"question_id": p["question_id"], "tokens": tokens, "stop_type": timing["stop_type"]})
                print(f"llama-server {' '.join(extra_args)} q{p['question_id']}: {len(tokens)} tokens", flush=True)
                continue
            body = {"prompt": p["ids"], "n_predict": max_new, "stream": False, "temperature": 0.0, "top_k": 1,
                    "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
                    "cache_prompt": False, "return_tokens": True, "n_probs": N_PROBS}
            req = urllib.request.Request(f"{server.url}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with _HTTP.open(req, timeout=3600) as r:
                res = json.loads(r.read())
            probs = [[(int(t["id"]), float(t["logprob"])) for t in step["top_logprobs"]]
                     for step in res["completion_probabilities"]]
            again = [int(x) for x in res.get("tokens") or []]
            if again != tokens:
                raise RuntimeError(f"q{p['question_id']}: llama-server gave other tokens with n_probs")
            if timing.get("stop_type") not in ("limit", "eos"):
                raise RuntimeError(f"q{p['question_id']}: llama-server stopped by {timing.get('stop_type')}")
            rows.append({"question_id": p["question_id"], "tokens": tokens, "stop_type": timing["stop_type"],
                         "top_logprobs": probs})
            print(f"llama-server q{p['question_id']}: {len(tokens)} tokens ({timing['stop_type']})", flush=True)
    return {"command": args[1:], "rows": rows}


# ------------------------------------------------------------------------------------------------
# stage: A, speculant's runtime on the file's blocks
# ------------------------------------------------------------------------------------------------

def run_speculant(prompts: list[dict], max_new: int) -> dict:
    from speculant import SpeculativeDecoder

    dec = SpeculativeDecoder(TARGET, target_quant="gguf", method="ar")
    rows = []
    for p in prompts:
        res = dec.generate(p["ids"], max_new_tokens=max_new, logprobs=N_PROBS)
        rows.append({"question_id": p["question_id"], "tokens": [int(t) for t in res.token_ids],
                     "finish_reason": res.finish_reason,
                     "top_logprobs": [[(int(t), float(lp)) for t, lp in x.top] for x in res.logprobs]})
        print(f"speculant q{p['question_id']}: {len(res.token_ids)} tokens ({res.finish_reason})", flush=True)
    return {"why": dec.why, "config": {"target_quant": dec.config.target_quant, "backend": dec.config.backend,
                                       "method": dec.config.method}, "rows": rows}


# ------------------------------------------------------------------------------------------------
# the emulation
# ------------------------------------------------------------------------------------------------

NAMES = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up",
         "ffn_down": "down", "attn_norm": "norm1", "ffn_norm": "norm2"}


def load_gguf_f32(path: Path) -> tuple[dict, dict, dict]:
    """(weights, GGUF type of each weight, model metadata): every tensor de-quantized to float32 by
    the ``gguf`` package, rows in chunks so the peak stays near the model's size."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def meta(key):
        return reader.fields[f"{arch}.{key}"].parts[-1][0].item()

    info = {"layers": int(meta("block_count")), "heads": int(meta("attention.head_count")),
            "kv_heads": int(meta("attention.head_count_kv")), "eps": float(meta("attention.layer_norm_rms_epsilon")),
            "rope_base": float(meta("rope.freq_base")), "hidden": int(meta("embedding_length"))}
    weights, kinds = {}, {}
    for t in reader.tensors:
        rows = int(np.prod(t.data.shape[:-1])) if t.data.ndim > 1 else 1
        data = t.data.reshape(rows, -1) if t.data.ndim > 1 else t.data.reshape(1, -1)
        out = None
        for r0 in range(0, rows, 8192):
            part = gguf.quants.dequantize(data[r0:r0 + 8192], t.tensor_type).astype(np.float32, copy=False)
            if out is None:
                out = torch.empty(rows, part.shape[-1], dtype=torch.float32)
            out[r0:r0 + part.shape[0]] = torch.from_numpy(np.ascontiguousarray(part))
        name = t.name
        if name.startswith("blk."):
            _, i, kind, what = name.split(".")
            name = f"{i}.{NAMES[kind]}.{what}"
        weights[name] = out if rows > 1 else out[0]
        kinds[name] = t.tensor_type.name
    return weights, kinds, info


def fake_q8k(x: torch.Tensor) -> torch.Tensor:
    """ggml's quantize_row_q8_K then de-quantized, in float32: per 256 values, iscale = 127 / amax
    (ggml's -127 / max flips both signs of code and scale, which leaves d * q as it is), codes
    rounded to nearest-even, d = 1 / iscale."""
    shape = x.shape
    b = x.reshape(-1, shape[-1] // 256, 256)
    amax = b.abs().amax(-1, keepdim=True)
    iscale = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(b * iscale).clamp(max=127)
    d = torch.where(amax > 0, 1.0 / iscale, torch.zeros_like(amax))
    return (q * d).reshape(shape)


def fake_spec(x: torch.Tensor, group: int) -> torch.Tensor:
    """speculant's int4 layers' activation rounding: bf16 input, per ``group`` values scale =
    amax / 127, codes = round-to-even(x * (127 / amax))."""
    shape = x.shape
    b = x.to(torch.bfloat16).float().reshape(-1, shape[-1] // group, group)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(b * inv)
    return (q * (amax / 127.0)).reshape(shape)


def round_to(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "f16":
        return x.half().float()
    if kind == "bf16":
        return x.bfloat16().float()
    return x


class Emulation:
    """The qwen2 forward in float32 over de-quantized weights, each rounding switched by ``cfg``."""

    def __init__(self, weights: dict, kinds: dict, info: dict, threads: int):
        self.w, self.kinds, self.info, self.threads = weights, kinds, info, threads
        self.head_dim = info["hidden"] // info["heads"]

    # -- pieces --------------------------------------------------------------------------------

    def linear(self, x, name, cfg, bias=None):
        if cfg["act"] == "q8k":
            x = fake_q8k(x)
        elif cfg["act"] == "spec":
            x = fake_spec(x, 16 if self.kinds[f"{name}.weight"] == "Q6_K" else 32)
        if cfg["dot"] == "f64" and name != "output":  # near llama.cpp's exact integer sums per block
            y = (x.double() @ self.w[f"{name}.weight"].double().T).float()
        else:
            y = x @ self.w[f"{name}.weight"].T
        if bias is not None:
            y = y + bias
        return y

    def norm(self, x, weight, cfg):
        if cfg["ggml_norm"]:
            mean = ((x * x).double().sum(-1, keepdim=True) / x.shape[-1]).float()
            scale = 1.0 / torch.sqrt(mean + np.float32(self.info["eps"]))
        else:
            scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.info["eps"])
        return (x * scale) * weight

    def rope_tables(self, T, cfg):
        d = self.head_dim
        pos = torch.arange(T, dtype=torch.float32)
        if cfg["ggml_rope"]:
            theta_scale = float(np.power(np.float32(self.info["rope_base"]), np.float32(-2.0) / np.float32(d),
                                         dtype=np.float32))
            theta = torch.empty(T, d // 2)
            theta[:, 0] = pos
            ts = torch.tensor(theta_scale, dtype=torch.float32)
            for i in range(1, d // 2):
                theta[:, i] = theta[:, i - 1] * ts
        else:  # transformers' default rotary embedding
            inv = 1.0 / (self.info["rope_base"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
            theta = pos[:, None] * inv[None, :]
        return torch.cos(theta), torch.sin(theta)

    @staticmethod
    def rope(x, cos, sin):  # x (H, T, d), neox halves
        h = x.shape[-1] // 2
        x0, x1 = x[..., :h], x[..., h:]
        return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1)

    def attention(self, q, k, v, P, cfg):
        """q (H, T, d), k and v (Hkv, T, d). With ``decode_attn`` ggml, rows as llama.cpp's CPU flash
        attention computes them: the prompt in batches of up to 512 rows (n_ubatch), a batch of >= 64
        rows by the tiled kernel (float32 query, softmax and sums: the plain softmax here), a smaller
        one row by row (``one_chunk``), and each generated token's row alone, by ``one_chunk`` with
        the keys split per thread from 512 cache cells on."""
        H, T, d = q.shape
        rep = H // k.shape[0]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        scale = np.float32(1.0 / math.sqrt(d))
        s = (q @ k.transpose(1, 2)) * scale
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        s = s.masked_fill(~causal, float("-inf"))
        out = torch.softmax(s, -1) @ v
        if cfg["decode_attn"] == "ggml":
            for u0 in range(0, P, UBATCH):
                u1 = min(u0 + UBATCH, P)
                if u1 - u0 < FA_TILE_Q:
                    out[:, u0:u1] = self.one_chunk(q[:, u0:u1], k, v, u0, scale, split=u1 - u0 == 1)
            if T > P:
                out[:, P:] = self.one_chunk(q[:, P:], k, v, P, scale, split=True)
        return out

    def one_chunk(self, q, k, v, P, scale, split):
        """ggml's CPU flash attention row by row (ggml_compute_forward_flash_attn_ext_f16_one_chunk
        with an F16 cache) for query rows at positions P, P+1, ...: Q rounded to f16; keys in order,
        online softmax in float32, the V accumulator in float16 (scaled and added to per key); with
        ``split`` (a batch of one row) and a cache view of >= 512 cells (padded to 256) the keys go
        in one chunk per thread, combined in float32 at the end."""
        H, R, d = q.shape
        T = k.shape[1]
        pos = torch.arange(P, P + R)
        s = (q.half().float() @ k.transpose(1, 2)) * scale  # (H, R, T)
        s = s.masked_fill(torch.arange(T)[None, None, :] > pos[None, :, None], float("-inf"))  # skipped keys
        n_kv = torch.clamp(((pos + 1 + 255) // 256) * 256, min=256)
        chunk = torch.where((n_kv >= 512) & split, (n_kv + self.threads - 1) // self.threads,
                            torch.full_like(n_kv, 1 << 30))
        ends_at = {}  # key index -> rows whose chunk ends after it
        for r, c in enumerate(chunk.tolist()):
            for e in range(c - 1, T, c):
                ends_at.setdefault(e, []).append(r)
        M = torch.full((H, R), float("-inf"))
        S = torch.zeros(H, R)
        acc = torch.zeros(H, R, d)
        Mf, Sf, accf = torch.full((H, R), float("-inf")), torch.zeros(H, R), torch.zeros(H, R, d)

        def fold(rows):  # ggml_flash_attn_ext_reduce_partials, one chunk at a time, in order
            nonlocal M, S, acc, Mf, Sf, accf
            use = rows[None, :] & (S != 0)
            Mn = torch.maximum(Mf, M)
            so, sn = torch.exp(Mf - Mn), torch.exp(M - Mn)
            accf = torch.where(use[..., None], accf * so[..., None] + acc * sn[..., None], accf)
            Sf = torch.where(use, Sf * so + S * sn, Sf)
            Mf = torch.where(use, Mn, Mf)
            M = torch.where(rows[None, :], float("-inf"), M)
            S = torch.where(rows[None, :], 0.0, S)
            acc = torch.where(rows[None, :, None], 0.0, acc)

        last = int(pos.max())
        for j in range(last + 1):
            sj = s[:, :, j]
            new = sj > M
            if bool(new.any()):  # a new maximum: V scaled by expf(Mold - M), rounded to f16
                ms = torch.where(new, torch.exp(M - sj), 1.0)
                acc = torch.where(new[..., None], (acc * ms[..., None]).half().float(), acc)
                M = torch.where(new, sj, M)
                S = S * ms
            vs = torch.exp(sj - M)
            if j > P:  # a skipped key (beyond the row's position) adds nothing
                vs = torch.where(torch.isneginf(sj), 0.0, vs)
            acc = (acc + v[:, j][:, None, :] * vs[..., None]).half().float()
            S = S + vs
            if j in ends_at:
                rows = torch.zeros(R, dtype=torch.bool)
                rows[ends_at[j]] = True
                fold(rows)
        fold(torch.ones(R, dtype=torch.bool))
        return accf * (1.0 / Sf)[..., None]

    # -- the model --------------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, ids: list[int], P: int, cfg: dict) -> torch.Tensor:
        """Log-softmax of the logits at positions P-1 .. len(ids)-1 (what follows each), float32."""
        cfg = {**BASE, **cfg}
        info, w = self.info, self.w
        T, H, Hkv, d = len(ids), info["heads"], info["kv_heads"], self.head_dim
        x = w["token_embd.weight"][torch.tensor(ids)]
        cos, sin = self.rope_tables(T, cfg)
        for i in range(info["layers"]):
            L = f"{i}"
            h = self.norm(x, w[f"{L}.norm1.weight"], cfg)
            q = self.linear(h, f"{L}.q", cfg, w[f"{L}.q.bias"]).view(T, H, d).transpose(0, 1)
            k = self.linear(h, f"{L}.k", cfg, w[f"{L}.k.bias"]).view(T, Hkv, d).transpose(0, 1)
            v = self.linear(h, f"{L}.v", cfg, w[f"{L}.v.bias"]).view(T, Hkv, d).transpose(0, 1)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            k, v = round_to(k, cfg["kv"]), round_to(v, cfg["kv"])
            a = self.attention(q, k, v, P, cfg).transpose(0, 1).reshape(T, H * d)
            x = round_to(x + self.linear(a, f"{L}.o", cfg), cfg["resid"])
            h = self.norm(x, w[f"{L}.norm2.weight"], cfg)
            g = self.linear(h, f"{L}.gate", cfg)
            u = self.linear(h, f"{L}.up", cfg)
            x = round_to(x + self.linear(torch.nn.functional.silu(g) * u, f"{L}.down", cfg), cfg["resid"])
        h = self.norm(x[P - 1:], w["output_norm.weight"], cfg)
        return torch.log_softmax(self.linear(h, "output", cfg), -1)


def hf_check(em: Emulation, ids: list[int], P: int) -> dict:
    """transformers' own Qwen2 in float32 over the same weights: B's logits, and C's with Q8_K
    rounding as forward pre-hooks on its nn.Linear modules, against this emulation's."""
    from transformers import AutoConfig, Qwen2ForCausalLM
    from speculant.store.models import resolve

    config = AutoConfig.from_pretrained(str(resolve(TARGET)))
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    inv = {v: k for k, v in NAMES.items()}
    hf_names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
                "norm1": "input_layernorm", "norm2": "post_attention_layernorm"}
    state = {"model.embed_tokens.weight": em.w["token_embd.weight"], "model.norm.weight": em.w["output_norm.weight"],
             "lm_head.weight": em.w["output.weight"]}
    for name, t in em.w.items():
        parts = name.split(".")
        if parts[0].isdigit():
            assert parts[1] in inv
            state[f"model.layers.{parts[0]}.{hf_names[parts[1]]}.{parts[2]}"] = t
    model.load_state_dict(state, assign=True, strict=True)
    rotary = model.model.rotary_emb
    rotary.inv_freq = 1.0 / (config.rope_parameters["rope_theta"]
                             ** (torch.arange(0, em.head_dim, 2, dtype=torch.int64).float() / em.head_dim))
    rotary.original_inv_freq = rotary.inv_freq
    model.eval()
    out = {}
    with torch.no_grad():
        for cfg_name in ("B", "C"):
            hooks = []
            if cfg_name == "C":
                for m in model.modules():
                    if isinstance(m, torch.nn.Linear):
                        hooks.append(m.register_forward_pre_hook(lambda _m, args: (fake_q8k(args[0]),)))
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, P - 1:].float(), -1)
            for hk in hooks:
                hk.remove()
            mine = em.logits(ids, P, CONFIGS[cfg_name])
            top1 = ref.argmax(-1, keepdim=True)
            out[cfg_name] = {"max_abs_logprob_diff": float((ref - mine).abs().max()),
                             "max_abs_top1_logprob_diff": float((ref.gather(-1, top1) - mine.gather(-1, top1)).abs().max()),
                             "positions": int(ref.shape[0]),
                             "positions_argmax_differs": int((ref.argmax(-1) != mine.argmax(-1)).sum())}
    del model
    gc.collect()
    return out


# ------------------------------------------------------------------------------------------------
# scoring
# ------------------------------------------------------------------------------------------------

def top(lps: list, k: int = 2) -> list:
    return [[int(t), round(float(lp), 4)] for t, lp in lps[:k]]


def score_row(ref: dict, mine_tokens: list[int], mine_top: list | None) -> dict:
    """First position where the tokens differ (None: the same text) and both sides' log-probabilities there."""
    ref_tokens = ref["tokens"]
    n = min(len(ref_tokens), len(mine_tokens))
    first = next((i for i in range(n) if ref_tokens[i] != mine_tokens[i]), None)
    if first is None and len(ref_tokens) != len(mine_tokens):
        first = n
    row = {"question_id": ref["question_id"], "same": first is None, "first_difference": first}
    if first is not None and first < len(ref_tokens):
        llama = dict((int(t), lp) for t, lp in ref["top_logprobs"][first])
        row["llama_top"] = top(ref["top_logprobs"][first])
        if mine_top is not None and first < len(mine_top):
            row["ours_top"] = top(mine_top[first])
        if first < len(mine_tokens):
            ours_tok = mine_tokens[first]
            row["llama_margin"] = (round(ref["top_logprobs"][first][0][1] - llama[ours_tok], 4)
                                   if ours_tok in llama else None)  # None: not in llama's top 5
    return row


def summarize(rows: list[dict], near: float, n_new: int) -> dict:
    diffs = [r["first_difference"] for r in rows if not r["same"]]
    margins = [r.get("llama_margin") for r in rows if not r["same"]]
    return {"same": sum(r["same"] for r in rows), "of": len(rows),
            "median_first_difference": statistics.median(diffs) if diffs else None,
            "median_first_difference_same_as_n": statistics.median(
                [n_new if r["same"] else r["first_difference"] for r in rows]),
            "near_ties": sum(1 for m in margins if m is not None and m < near),
            "first_differences": {r["question_id"]: r["first_difference"] for r in rows}}


def run_emulation(prompts, llama, names, threads, near, max_new, check_hf, work: Path) -> None:
    """Each configuration's result as ``work/emulate-NAME.json`` (kept: a rerun computes the missing ones)."""
    from speculant.store.models import gguf_path

    t0 = time.time()
    w, kinds, info = load_gguf_f32(gguf_path(TARGET))
    print(f"de-quantized the GGUF to float32 in {time.time() - t0:.0f} s", flush=True)
    em = Emulation(w, kinds, info, threads)
    ref = {r["question_id"]: r for r in llama["rows"]}
    check = work / "hf_check.json"
    if check_hf and not check.exists():
        p = prompts[0]
        res = hf_check(em, p["ids"] + ref[p["question_id"]]["tokens"][:-1], len(p["ids"]))
        check.write_text(json.dumps(res) + "\n")
        print(f"transformers check: {res}", flush=True)
    for name in names:
        if (work / f"emulate-{name}.json").exists():
            continue
        rows = []
        for p in prompts:
            r = ref[p["question_id"]]
            ids = p["ids"] + r["tokens"][:-1]
            lp = em.logits(ids, len(p["ids"]), CONFIGS[name])
            vals, idx = lp.topk(N_PROBS, -1)
            mine = idx[:, 0].tolist()
            tops = [list(zip(i.tolist(), v.tolist())) for i, v in zip(idx, vals)]
            rows.append(score_row(r, mine, tops))
        res = {"settings": {**BASE, **CONFIGS[name]}, "summary": summarize(rows, near, max_new), "rows": rows}
        (work / f"emulate-{name}.json").write_text(json.dumps(res) + "\n")
        s = res["summary"]
        print(f"{name:>10}: same {s['same']}/{s['of']}, median first difference {s['median_first_difference']}, "
              f"near-ties {s['near_ties']}", flush=True)


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------

def stage(name: str, args, done: Path) -> None:
    """Run one stage in its own process (so each frees its memory) unless ``done`` is kept."""
    if not done.exists():
        cmd = [sys.executable, __file__, "--stage", name, "--work", args.work, "--threads", str(args.threads),
               "--max-new-tokens", str(args.max_new_tokens), "--configs", args.configs, "--near-tie", str(args.near_tie)]
        if args.no_hf_check:
            cmd.append("--no-hf-check")
        subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=",".join(ORDER), help=f"of {', '.join(ORDER)}")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2, help="llama-server's threads (its decode attention splits keys by them)")
    ap.add_argument("--near-tie", type=float, default=0.1)
    ap.add_argument("--work", default=os.path.expanduser("~/.cache/speculant/llama-numerics"),
                    help="where each stage's results are kept (delete a file to run its stage again)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-hf-check", action="store_true")
    ap.add_argument("--stage", choices=("llama", "speculant", "emulate") + tuple(VARIANTS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = [c for c in args.configs.split(",") if c]
    for c in names:
        if c not in ORDER:
            ap.error(f"unknown config {c}: choose from {', '.join(ORDER)}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    prompts = held_out_prompts(tokenizer())

    if args.stage == "llama":
        (work / "llama.json").write_text(json.dumps(run_llama(prompts, args.max_new_tokens, args.threads)) + "\n")
    elif args.stage == "speculant":
        (work / "speculant.json").write_text(json.dumps(run_speculant(prompts, args.max_new_tokens)) + "\n")
    elif args.stage == "emulate":
        llama = json.loads((work / "llama.json").read_text())
        run_emulation(prompts, llama, [c for c in names if c in CONFIGS], args.threads, args.near_tie,
                      args.max_new_tokens, not args.no_hf_check, work)
    elif args.stage in VARIANTS:
        res = run_llama(prompts, args.max_new_tokens, args.threads, VARIANTS[args.stage], probs=False)
        (work / f"{args.stage}.json").write_text(json.dumps(res) + "\n")
    if args.stage:
        return

    from speculant.provenance import git_info, machine_info

    stage("llama", args, work / "llama.json")
    llama = json.loads((work / "llama.json").read_text())
    out = {"date": datetime.date.today().isoformat(), "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
           "git": git_info(), "machine": machine_info(), "target": TARGET, "max_new_tokens": args.max_new_tokens,
           "near_tie_nats": args.near_tie,
           "prompts": [{"question_id": p["question_id"], "category": p["category"], "prompt_tokens": len(p["ids"])}
                       for p in prompts],
           "llama_server": {"command": llama["command"],
                            "rows": [{k: r[k] for k in ("question_id", "tokens", "stop_type")} for r in llama["rows"]]},
           "configs": {}}
    if "A" in names:
        stage("speculant", args, work / "speculant.json")
        spec = json.loads((work / "speculant.json").read_text())
        ref = {r["question_id"]: r for r in llama["rows"]}
        rows = [score_row(ref[r["question_id"]], r["tokens"], r["top_logprobs"]) for r in spec["rows"]]
        out["configs"]["A"] = {"settings": {"runtime": "speculant", **spec["config"], "why": spec["why"]},
                               "summary": summarize(rows, args.near_tie, args.max_new_tokens), "rows": rows,
                               "tokens": {r["question_id"]: r["tokens"] for r in spec["rows"]}}
    for c in names:
        if c in VARIANTS:
            stage(c, args, work / f"{c}.json")
            var = json.loads((work / f"{c}.json").read_text())
            ref = {r["question_id"]: r for r in llama["rows"]}
            rows = [score_row(ref[r["question_id"]], r["tokens"], None) for r in var["rows"]]
            out["configs"][c] = {"settings": {"runtime": "llama-server", "extra_args": list(VARIANTS[c])},
                                 "summary": summarize(rows, args.near_tie, args.max_new_tokens), "rows": rows}
    emulated = [c for c in names if c in CONFIGS]
    if emulated:
        missing = [c for c in emulated if not (work / f"emulate-{c}.json").exists()]
        if missing or not (args.no_hf_check or (work / "hf_check.json").exists()):
            stage("emulate", args, work / "never")
        for c in emulated:
            out["configs"][c] = json.loads((work / f"emulate-{c}.json").read_text())
        if (work / "hf_check.json").exists():
            out["transformers_check"] = json.loads((work / "hf_check.json").read_text())
    print(f"\n{'config':>10}  same/{len(prompts)}  median first diff  near-ties")
    for name in ORDER:
        if name in out["configs"]:
            s = out["configs"][name]["summary"]
            print(f"{name:>10}  {s['same']:>7}  {str(s['median_first_difference']):>17}  {s['near_ties']:>9}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
