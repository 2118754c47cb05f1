"""quant-eval's llama.cpp reference (bench.llama_reference): llama-perplexity's log-probability file
is read back as it was written (its tokens, and each scored position's log-probabilities to the
file's 16-bit resolution), and a runtime is scored by llama-perplexity's protocol on those tokens:
its KL from llama.cpp's distribution is ~0 and its top-1 agreement 1 where it is that distribution,
and neither where it is not."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from speculant.bench.llama_reference import LlamaReference, protocol_scores, read_logits_file
from speculant.errors import ConfigError


def write_logits_file(path, tokens: np.ndarray, logits: np.ndarray) -> None:
    """The file llama-perplexity --kl-divergence-base writes (tools/perplexity/perplexity.cpp):
    tokens (n_chunk, n_ctx), logits (n_chunk, scored, n_vocab) of the scored positions."""
    n_chunk, n_ctx = tokens.shape
    n_vocab = logits.shape[-1]
    nv = 2 * ((n_vocab + 1) // 2) + 4
    out = [b"_logits_", np.array([n_ctx, n_vocab, n_chunk], dtype="<i4").tobytes(), tokens.astype("<i4").tobytes()]
    for row in logits.reshape(-1, n_vocab).astype(np.float32):
        mx, mn = row.max(), max(row.min(), row.max() - 16)
        lse = np.float32(np.log(np.exp(row - mx).astype(np.float64).sum()))
        scale = np.float32((mx - mn) / 65535)
        codes = np.where(row > mn, np.rint((row - mn) / scale), 0).astype("<u2")
        rec = np.zeros(nv, dtype="<u2")
        rec[:4] = np.array([scale, mn - mx - lse], dtype="<f4").view("<u2")
        rec[4:4 + n_vocab] = codes
        out.append(rec.tobytes())
    path.write_bytes(b"".join(out))


def test_the_log_probability_file_reads_back(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 7, (2, 8))
    logits = rng.normal(0, 3, (2, 3, 7)).astype(np.float32)  # n_ctx 8: positions 4, 5, 6 scored
    write_logits_file(tmp_path / "base.kld", tokens, logits)
    got_tokens, logp = read_logits_file(tmp_path / "base.kld")
    assert np.array_equal(got_tokens, tokens) and logp.shape == (2, 3, 7)
    want = torch.from_numpy(logits).log_softmax(-1).numpy()
    assert np.abs(logp - want).max() < 16 / 65535 + 1e-5  # the file's resolution
    (tmp_path / "bad").write_bytes(b"something else")
    with pytest.raises(ConfigError, match="not a llama-perplexity"):
        read_logits_file(tmp_path / "bad")


class FixedBackend:
    """A runtime whose next-token logits at position p of a chunk are table[token at p]."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def reset(self) -> None:
        pass

    def forward(self, ids: torch.Tensor, rows: torch.Tensor):
        return SimpleNamespace(logits=self.table[ids[rows]])


def test_a_runtime_is_scored_on_llama_cpps_tokens_by_its_protocol(tmp_path):
    rng = np.random.default_rng(1)
    V, n_ctx = 6, 8
    table = torch.from_numpy(rng.normal(0, 2, (V, V)).astype(np.float32))  # llama.cpp's model: a bigram table
    tokens = rng.integers(0, V, (3, n_ctx))
    first = n_ctx // 2
    logits = table[torch.from_numpy(tokens[:, first:-1])].numpy()  # what llama.cpp wrote at each scored position
    write_logits_file(tmp_path / "base.kld", tokens, logits)
    toks, logp = read_logits_file(tmp_path / "base.kld")
    ref = LlamaReference(torch.from_numpy(toks.astype(np.int64)), 0.0, torch.from_numpy(logp), False, None)
    same = protocol_scores(FixedBackend(table), ref)
    assert same["positions"] == 3 * (n_ctx - 1 - first) and same["top1_as_llama_cpp"] == 1.0
    assert abs(same["kl_from_llama_cpp"]) < 1e-3
    lp = table.log_softmax(-1)
    nll = -sum(float(lp[a, b]) for t in tokens for a, b in zip(t[first:-1], t[first + 1:]))
    assert same["perplexity"] == pytest.approx(math.exp(nll / same["positions"]), rel=1e-5)
    other = protocol_scores(FixedBackend(table.flip(-1)), ref)  # another model: the negative control
    assert other["kl_from_llama_cpp"] > 0.1 and other["top1_as_llama_cpp"] < 1.0
