"""The quality cost of quantizing the target (``speculant quant-eval``).

Two measures, each against the same model unquantized (bf16), all on the native backend:

perplexity   exp(mean NLL) of the target on a fixed bundled text (the first 6 KB of CPython's
             ``textwrap.py``, ~1.4k tokens; ``data/NOTICE.md``), scored causally in chunks of
             ``CHUNK`` tokens through the KV cache (the same as one pass over the whole text).
kl, top-1    on the same text, position by position: the mean KL divergence of the model's
             next-token distribution from the bf16 model's, and the fraction of positions whose
             argmax is the bf16 model's (steadier than perplexity, which errors can cancel in).
llama.cpp    with the mode ``llama.cpp`` in ``modes`` (a GGUF target): llama.cpp's own ``llama-perplexity``
             is run on the same text (``bench.llama_reference``), and every mode is also scored on
             llama.cpp's tokens by its protocol: perplexity, KL from llama.cpp's distribution and
             top-1 agreement with it (``vs_llama_cpp``): how close each runtime is to the file as
             llama.cpp runs it.
agreement    the bf16 model's greedy continuations of ``PROMPTS`` (chat template,
             ``max_new_tokens`` each) are scored by the quantized model in one pass per prompt
             (teacher forcing): agreement = fraction of positions where its argmax equals the bf16
             greedy token. The first position where they differ is exactly where the quantized
             model's own greedy decoding would first differ from bf16's (before it, both decode the
             same prefix), reported as tokens before the first difference (= max_new_tokens when
             there is none). Scoring, rather than free-running decoding, keeps one early
             difference from counting every later token, and costs 4 passes instead of 256 steps.

Quantized layers here keep no dense weight (as the native backend's quantized target): every
pass, of any width, uses the quantized weights.

    python -m speculant.bench.quality --target qwen2.5-coder-1.5b-instruct
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from importlib import resources

import torch

from ..backends.native import NativeBackend, NativeModel
from ..config import SamplingConfig
from ..decoding import decode
from ..drafters.lookup import LookupDrafter
from ..store.chat import chat_prompt
from ..store.models import load

CHUNK = 128  # <= Int4Linear.max_kernel_rows: the text is scored through the kernel that decodes
PROMPTS = (
    "Write a Python function that merges overlapping intervals.",
    "Explain the difference between a process and a thread in a few sentences.",
    "Translate into German: The weather is nice today, so we will walk to the station.",
    "A train travels 120 km in 1.5 hours. What is its average speed? Explain step by step.",
)


def quality_text() -> str:
    return resources.files("speculant").joinpath("data/quality_textwrap.py.txt").read_text()


@torch.inference_mode()
def text_scores(backend, ids: torch.Tensor,
                reference: torch.Tensor | None = None) -> tuple[float, float, float, torch.Tensor]:
    """(perplexity of ids[1:] given their prefixes, mean KL from ``reference``, top-1 agreement
    with it, this model's log-probabilities (T-1, V) as float16 to serve as a reference)."""
    backend.reset()
    nll, kl, top1, count, logps = 0.0, 0.0, 0, 0, []
    for s in range(0, ids.shape[0] - 1, CHUNK):
        chunk = ids[s:s + CHUNK]
        nxt = ids[s + 1:s + 1 + CHUNK]
        lp = backend.forward(chunk).logits[: nxt.shape[0]].float().log_softmax(-1)  # (c, V)
        nll -= lp.gather(1, nxt[:, None]).sum().item()
        if reference is not None:
            ref = reference[count:count + nxt.shape[0]].float()
            kl += (ref.exp() * (ref - lp)).sum().item()
            top1 += int((lp.argmax(-1) == ref.argmax(-1)).sum())
        logps.append(lp.half())
        count += nxt.shape[0]
    return math.exp(nll / count), kl / count, top1 / count, torch.cat(logps)


@torch.inference_mode()
def sampled_nll(backend, prompt: torch.Tensor, tokens: list[int], temperature: float) -> float | None:
    """Mean -log p_T(x_t | prompt, x_<t) of the generated ``tokens`` under the model at
    ``temperature`` (one pass of ``backend``, which is reset): for a lossless sampler its expected
    value is the same whatever the method; an approximate acceptance rule that favours likely
    tokens lowers it. None for no tokens."""
    if not tokens:
        return None
    ids = torch.cat([prompt, torch.tensor(tokens, dtype=torch.long)])
    backend.reset()
    n0, n, nll = prompt.shape[0], ids.shape[0], 0.0
    # position p predicts token p + 1: positions n0 - 1 .. n - 2 predict the generated tokens
    for s in range(0, n - 1, CHUNK):
        chunk = ids[s:s + CHUNK]
        first, last = max(n0 - 1, s), min(s + chunk.shape[0], n - 1)  # this chunk's such positions [first, last)
        rows = torch.arange(first - s, last - s) if first < last else torch.empty(0, dtype=torch.long)
        out = backend.forward(chunk, rows=rows)  # a chunk of the prompt alone fills the cache only
        if rows.numel():
            lp = (out.logits.float() / temperature).log_softmax(-1)  # (r, V)
            nll -= lp.gather(1, ids[s + rows + 1][:, None]).sum().item()
    backend.reset()
    return nll / len(tokens)


def perplexity(backend, ids: torch.Tensor) -> float:
    """exp(mean NLL of ids[1:] given their prefixes)."""
    return text_scores(backend, ids)[0]


def greedy(backend, ids: torch.Tensor, n: int, eos: set[int]) -> list[int]:
    """Plain greedy decoding, sped up losslessly by prompt lookup (same output as ``ar``)."""
    state = None
    with torch.inference_mode():
        for state, _ in decode(backend, LookupDrafter(4), ids, max_new_tokens=n,  # noqa: B007 -- the last state is the result
                               sampling=SamplingConfig(), eos_token_ids=eos):
            pass
    return state.generated


@torch.inference_mode()
def teacher_forced(backend, prompt: torch.Tensor, ref: list[int]) -> tuple[int, int, int]:
    """(positions whose argmax equals ref, len(ref), tokens before the first difference)."""
    backend.reset()
    seq = torch.cat([prompt, torch.tensor(ref[:-1], dtype=torch.long)])
    rows = torch.arange(prompt.shape[0] - 1, seq.shape[0])  # the rows predicting ref[0..]
    best = backend.forward(seq, rows=rows).logits.argmax(-1).tolist()
    same = [a == b for a, b in zip(best, ref)]
    first = same.index(False) if False in same else len(ref)
    return sum(same), len(ref), first


# gguf: int4, with the layers that are Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 in the GGUF file running the
# file's own blocks
MODES = ("none", "int8", "int4", "int8+head", "int4+head", "gguf", "gguf+head")
LLAMA_CPP = "llama.cpp"  # not a runtime of ours: llama.cpp's scores of the file, the reference of vs_llama_cpp


def run_quality(target: str, modes=MODES, max_new_tokens: int = 64, json_out: str | None = None) -> dict:
    from datetime import datetime, timezone

    from ..errors import ConfigError
    from ..output_paths import check_output_file

    if not modes or any(m not in MODES + (LLAMA_CPP,) for m in modes):  # before the model loads
        raise ConfigError(f"--modes takes a comma-separated list of {', '.join(MODES + (LLAMA_CPP,))}; got "
                          f"{','.join(modes)!r}")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if json_out:
        check_output_file(json_out, "--json-out")
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    lm = load(target, "bfloat16")
    tok = lm.tokenizer
    text_ids = tok(quality_text(), return_tensors="pt").input_ids[0]
    prompts = [tok(chat_prompt(tok, p), add_special_tokens=False, return_tensors="pt").input_ids[0] for p in PROMPTS]
    eos = {tok.eos_token_id}
    results, reference, ref_logp, llama = {}, None, None, None
    if LLAMA_CPP in modes:
        from ..store.gguf_linears import source_gguf
        from .llama_reference import llama_reference

        llama = llama_reference(source_gguf(target), quality_text())
        results[LLAMA_CPP] = {"perplexity": llama.perplexity,
                              "positions": int(llama.logprobs.shape[0] * llama.logprobs.shape[1])}
        print(f"{LLAMA_CPP:>10}: perplexity {llama.perplexity:.4f} (llama-perplexity, chunks of "
              f"{llama.tokens.shape[1]} tokens, the second half of each scored)", flush=True)
    for mode in ("none",) + tuple(m for m in modes if m not in ("none", LLAMA_CPP)):
        quant, _, head = mode.partition("+")
        t = time.perf_counter()
        model = NativeModel.from_hf(lm.model, "int4" if quant == "gguf" else quant,
                                    quant_head=bool(head) and quant != "none", keep_dense=False)
        if quant == "gguf":
            from ..store.gguf_linears import apply_gguf_blocks, source_gguf

            apply_gguf_blocks(model, source_gguf(target))
        backend = NativeBackend(model)
        ppl, kl, top1, logp = text_scores(backend, text_ids, ref_logp)
        ref_logp = logp if ref_logp is None else ref_logp
        del logp
        if reference is None:  # the bf16 model's own greedy continuations
            reference = [greedy(backend, p, max_new_tokens, eos) for p in prompts]
        agree = [teacher_forced(backend, p, r) for p, r in zip(prompts, reference)]
        results[mode] = {
            "perplexity": ppl,
            "kl_from_bf16": kl,
            "top1_agreement_text": top1,
            "agreement": sum(a[0] for a in agree) / sum(a[1] for a in agree),
            "mean_tokens_before_first_difference": sum(a[2] for a in agree) / len(agree),
            "per_prompt_first_difference": [a[2] for a in agree],
            "seconds": time.perf_counter() - t,
        }
        if llama is not None:
            from .llama_reference import protocol_scores

            results[mode]["vs_llama_cpp"] = vs = protocol_scores(backend, llama)
            print(f"{'':>10}  on llama.cpp's tokens: perplexity {vs['perplexity']:.4f} "
                  f"(llama.cpp {llama.perplexity:.4f}, {100 * (vs['perplexity'] / llama.perplexity - 1):+.2f}%)  "
                  f"KL from llama.cpp {vs['kl_from_llama_cpp']:.4f}"
                  f"  top-1 as llama.cpp {vs['top1_as_llama_cpp']:.3f}", flush=True)
        print(f"{mode:>10}: perplexity {ppl:.4f}  KL from bf16 {kl:.4f}  top-1 as bf16 {top1:.3f}  "
              f"greedy agreement {results[mode]['agreement']:.3f}  "
              f"first difference after {results[mode]['mean_tokens_before_first_difference']:.1f} tokens "
              f"(per prompt {results[mode]['per_prompt_first_difference']})", flush=True)
        del backend
        gc.collect()
    from .harness import command_line, git_info, machine_info

    out = {"date": started, "command": command_line(), "machine": machine_info(), **git_info(),
           "target": target, "text_tokens": int(text_ids.shape[0]), "prompts": list(PROMPTS),
           "max_new_tokens": max_new_tokens, "reference_lengths": [len(r) for r in reference],
           "results": results}
    if json_out:
        with open(json_out, "w") as f:
            json.dump(out, f, indent=1)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="quality cost of target quantization")
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    run_quality(a.target, tuple(a.modes.split(",")), a.max_new_tokens, a.json_out)


if __name__ == "__main__":
    main()
