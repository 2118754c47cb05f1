"""The llama.cpp peer row of the bench: llama.cpp's own plain greedy decoding of the target's GGUF.

llama-cpp-python is a benchmark extra (``make install-llamacpp``), never a test dependency: when
it is not importable the bench skips this row and says why. The model is the same GGUF file that
speculant converts (``models.gguf_path``: the preset's file assembled from its packages and
checked against its SHA-256), in llama.cpp's own Q4_K_M / Q4_1 quantization; it is fed the same
prompt token ids as every other row (the converted tokenizer and the GGUF's share their ids), and
decodes greedily (top-k 1, no repetition penalty) until EOS or ``max_new_tokens``. The time
includes the prompt's prefill, like the other rows.
"""

from __future__ import annotations

import os
import time

import torch

from ..errors import ConfigError
from ..models import gguf_path


def llamacpp_unavailable() -> str | None:
    """None when llama_cpp imports, else the reason (with the fix)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # ImportError, or a broken native library
        return (f"llama_cpp is not importable ({type(e).__name__}: {e}); install it with "
                "`make install-llamacpp` (builds llama-cpp-python from source, 7-9 min)")
    return None


class LlamaCppPlain:
    """Plain greedy decoding through llama.cpp. run(ids, n) -> (token ids, wall seconds)."""

    def __init__(self, spec: str, tokenizer, n_ctx: int = 4096, n_threads: int | None = None):
        from llama_cpp import Llama

        path = gguf_path(spec)
        if path is None:
            raise ConfigError(f"no GGUF file behind {spec!r}: the llamacpp row needs a preset, a .gguf "
                              "file, or a speculant cache directory converted from one")
        self.path = path
        threads = n_threads or torch.get_num_threads() or os.cpu_count()
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False)
        eos = {tokenizer.eos_token_id, self.llm.token_eos()}
        self.eos = eos - {None, -1}

    def run(self, ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], float]:
        out: list[int] = []
        t = time.perf_counter()
        self.llm.reset()  # no reuse of a previous run's KV cache: every row pays its prefill
        for tok in self.llm.generate(ids.tolist(), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                     repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok in self.eos or len(out) >= max_new_tokens:
                break
        return out, time.perf_counter() - t
