"""llama.cpp's own scores of a text, for ``speculant quant-eval --modes ...,llama.cpp``: what the
user's GGUF gives in llama.cpp, to compare speculant's runtimes with on the very same tokens.

``llama-perplexity`` (built by ``make install-llama-server``) is run once on the text with
``--kl-divergence-base FILE``, which makes it write, besides its perplexity, its own tokenization
of the text and its log-probabilities at every scored position. The file's layout (llama.cpp's
``tools/perplexity/perplexity.cpp``): ``"_logits_"``, int32 n_ctx, int32 n_vocab, int32 n_chunk,
int32 tokens (n_chunk * n_ctx), then for each chunk and each scored position (n_ctx - 1 - n_ctx/2 of
them: the second half of the chunk, each predicting the next token) float32 scale, float32 min_lp,
and uint16 codes (n_vocab, padded to an even count): log p ~ min_lp + scale * code (code 0: at most
min_lp).

llama-perplexity's protocol, which :func:`protocol_scores` follows for speculant's runtimes: the
tokens are cut into chunks of n_ctx, each scored from a fresh cache, its first token replaced by BOS
when the model adds one, and only the positions from n_ctx/2 on are scored.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from .llama_server import INSTALL_HINT, llama_server_dir

__all__ = ["LlamaReference", "llama_perplexity_binary", "llama_reference", "protocol_scores"]


def llama_perplexity_binary() -> Path:
    """The installed ``llama-perplexity``, or a clear error with the command that builds it."""
    path = llama_server_dir() / "bin" / "llama-perplexity"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ConfigError(f"llama-perplexity is not installed in {path.parent}; {INSTALL_HINT}")
    return path


@dataclass(frozen=True)
class LlamaReference:
    """llama.cpp's scores of a text: its tokens (n_chunk, n_ctx) int64, its perplexity, and its
    log-probabilities at the scored positions (n_chunk, n_ctx - 1 - n_ctx // 2, V) float32."""

    tokens: torch.Tensor
    perplexity: float
    logprobs: torch.Tensor
    add_bos: bool
    bos: int | None

    @property
    def first(self) -> int:
        return self.tokens.shape[1] // 2


def read_logits_file(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """(tokens (n_chunk, n_ctx) int32, log-probabilities (n_chunk, n_ctx - 1 - n_ctx // 2, n_vocab)
    float32) of a ``--kl-divergence-base`` file (module docstring)."""
    raw = Path(path).read_bytes()
    if raw[:8] != b"_logits_":
        raise ConfigError(f"{path} is not a llama-perplexity log-probability file")
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw, dtype="<i4", count=3, offset=8)
    at = 20
    tokens = np.frombuffer(raw, dtype="<i4", count=n_chunk * n_ctx, offset=at).reshape(n_chunk, n_ctx)
    at += 4 * n_chunk * n_ctx
    scored = n_ctx - 1 - n_ctx // 2
    nv = 2 * ((n_vocab + 1) // 2) + 4  # uint16 per position, its two float32 included
    rows = np.frombuffer(raw, dtype="<u2", count=n_chunk * scored * nv, offset=at).reshape(n_chunk * scored, nv)
    head = np.ascontiguousarray(rows[:, :4]).view("<f4")  # (P, 2): scale, min_lp
    codes = rows[:, 4:4 + n_vocab].astype(np.float32)
    logp = head[:, 1:2] + head[:, 0:1] * codes
    return tokens, logp.reshape(n_chunk, scored, n_vocab)


def llama_reference(gguf: str | os.PathLike, text: str, n_ctx: int = 256, threads: int | None = None) -> LlamaReference:
    """Run ``llama-perplexity`` on ``text`` with the model ``gguf`` (chunks of ``n_ctx`` tokens) and
    read back its tokens, perplexity and log-probabilities."""
    from gguf import GGUFReader

    from ..store.gguf_meta import meta_value

    binary = llama_perplexity_binary()
    threads = threads or max(1, os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="speculant-llama-ppl-") as tmp:
        text_file, base = Path(tmp) / "text.txt", Path(tmp) / "base.kld"
        text_file.write_text(text)
        cmd = [str(binary), "-m", str(gguf), "-f", str(text_file), "-c", str(n_ctx), "-b", str(n_ctx),
               "-t", str(threads), "--kl-divergence-base", str(base)]
        env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
        run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
        if run.returncode != 0 or found is None or not base.is_file():
            tail = (run.stdout + run.stderr)[-1500:]
            raise ConfigError(f"llama-perplexity failed (exit {run.returncode}) on {gguf}: {tail}")
        tokens, logp = read_logits_file(base)
    reader = GGUFReader(str(gguf))
    add_bos = bool(meta_value(reader, "tokenizer.ggml.add_bos_token") or False)
    bos = meta_value(reader, "tokenizer.ggml.bos_token_id")
    return LlamaReference(torch.from_numpy(tokens.astype(np.int64)), float(found.group(1)),
                          torch.from_numpy(logp), add_bos, None if bos is None else int(bos))


@torch.inference_mode()
def protocol_scores(backend, ref: LlamaReference) -> dict[str, float]:
    """A speculant runtime (``backend``) scored as llama-perplexity scores the GGUF, on llama.cpp's
    tokens: its perplexity, its mean KL divergence from llama.cpp's distribution (as
    ``llama-perplexity --kl-divergence`` computes it), and the share of scored positions where its
    top token is llama.cpp's."""
    nll, kl, same, count = 0.0, 0.0, 0, 0
    first = ref.first
    for c in range(ref.tokens.shape[0]):
        chunk = ref.tokens[c].clone()
        if ref.add_bos and ref.bos is not None:
            chunk[0] = ref.bos
        backend.reset()
        rows = torch.arange(first, chunk.shape[0] - 1)
        lp = backend.forward(chunk, rows=rows).logits.float().log_softmax(-1)  # (S, V)
        theirs = ref.logprobs[c, :, :lp.shape[1]]
        nll -= lp.gather(1, chunk[first + 1:][:, None]).sum().item()
        # llama.cpp's own KL (perplexity.cpp): over the tokens whose log-probability in its file is
        # above -16 (below that the file's 16-bit codes say only "at most min_lp")
        kept = theirs > -16.0
        kl += torch.where(kept, theirs.exp() * (theirs - lp), torch.zeros_like(lp)).sum().item()
        same += int((lp.argmax(-1) == theirs.argmax(-1)).sum())
        count += lp.shape[0]
    backend.reset()
    return {"perplexity": float(np.exp(nll / count)), "kl_from_llama_cpp": kl / count,
            "top1_as_llama_cpp": same / count, "positions": count}
