"""What head training runs on: the backbone with its heads (:class:`Trainable`) and, for a frozen
backbone, a table of its final hidden states computed once (:class:`FeatureTable`), with the losses
that read that table (the feature and teacher losses of sequential heads).

Shapes: B windows of T tokens, H = hidden size, V = vocabulary size (V' when training over the
data's tokens only), K = number of heads, N = rows of a table, n = rows of a micro-batch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..heads import MedusaHeads, SequentialHeads
from .data import collate
from .losses import row_inputs, row_targets

__all__ = ["FeatureTable", "Trainable", "feature_loss", "feature_tables", "teacher_loss"]


class Trainable(nn.Module):
    """Backbone + heads: ``forward(ids, attn, joint, hidden) -> (lm_logits (B, T, V) | None, heads (K, B, T, V))``.
    Without ``joint`` the backbone runs under no_grad (Medusa-1, and Medusa-2's warm-up); a given
    ``hidden`` (B, T, H) (the frozen backbone's, from a :class:`FeatureTable`) skips the backbone."""

    def __init__(self, model: nn.Module, heads: MedusaHeads | SequentialHeads):
        super().__init__()
        self.model, self.heads = model, heads

    def forward(self, ids: torch.Tensor, attn: torch.Tensor, joint: bool = False, hidden: torch.Tensor | None = None,
                tokens: torch.Tensor | None = None, vocab: torch.Tensor | None = None, want_states: bool = False,
                seq: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """``tokens`` (n, K): the inputs of sequential heads (``FeatureTable.inputs``); ``vocab``
        (V',): score only these tokens (``TrainConfig.train_vocab``). ``want_states`` (sequential
        heads): also return their states (K, n, H), as a third value. ``seq`` (heads with a context
        layer, instead of ``hidden``): windows of backbone states (B, T, H) and the (window, position)
        (n,), (n,) of each row (``FeatureTable.window_batch``)."""
        if seq is not None:  # heads with a context layer: it reads whole windows, the heads its rows
            hidden = self.heads.context(seq[0].to(self.heads.dtype))[seq[1], seq[2]]
        if hidden is None:
            hidden = self.backbone(ids, attn, joint)
        lm = self.model.get_output_embeddings()(hidden) if joint else None
        if want_states:
            states = self.heads.unroll(hidden, tokens)
            return lm, self.heads.project(states, vocab), states
        return lm, self.heads(hidden, tokens, vocab)

    def backbone(self, ids: torch.Tensor, attn: torch.Tensor, joint: bool = False) -> torch.Tensor:
        with torch.set_grad_enabled(joint and torch.is_grad_enabled()):
            return self.model.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state  # (B, T, H)


class FeatureTable:
    """Medusa-1 trains against a frozen backbone, so its final hidden states never change: compute
    them once, keep one row per position that some head learns from, and train on shuffled rows
    (heads act position by position, so rows need no padding and batches mix sequences freely).

    hidden (N, H) in the backbone's dtype; targets (N, K) long, head k's target token at that
    position or -1 (``losses.row_targets``); inputs (N, K) long, the tokens t+1 .. t+K that
    sequential heads read (``losses.row_inputs``); next_rows (N, K) long, the row holding the
    hidden state of position t+1+d, or -1 (the feature loss's targets). ~3 KB a row for a 1.5B
    model in bf16.

    With ``windows`` (for heads with a context layer, which read whole sequences): the backbone
    states of every window, prompt included (list of (T_w, H)); ``starts`` (W + 1,) long, window w's
    rows being ``starts[w] .. starts[w+1]-1``; ``positions`` (N,) long, each row's position in its window."""

    def __init__(self, hidden: torch.Tensor, targets: torch.Tensor, inputs: torch.Tensor, next_rows: torch.Tensor,
                 windows: list[torch.Tensor] | None = None, starts: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None):
        self.hidden, self.targets, self.inputs, self.next_rows = hidden, targets, inputs, next_rows
        self.windows, self.starts, self.positions = windows, starts, positions
        self._perm: tuple[int, torch.Tensor] | None = None  # (epoch, its permutation)

    def saved(self) -> tuple:
        return (self.hidden, self.targets, self.inputs, self.next_rows, self.windows, self.starts, self.positions)

    def window_batch(self, ws: Sequence[int], noise: float = 0.0,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, tuple]:
        """Windows ``ws`` -> (their rows (n,), ``seq`` for ``Trainable``: the windows' states padded
        on the right (B, T, H), with ``noise`` as in ``TrainConfig.feature_noise`` (drawn from
        ``generator``), and each row's (window in the batch, position))."""
        T = max(self.windows[w].shape[0] for w in ws)
        pad = self.windows[ws[0]].new_zeros(len(ws), T, self.windows[ws[0]].shape[1])
        rows, b_of, pos = [], [], []
        for b, w in enumerate(ws):
            pad[b, : self.windows[w].shape[0]] = self.windows[w]
            r = torch.arange(int(self.starts[w]), int(self.starts[w + 1]))
            rows.append(r)
            b_of.append(torch.full_like(r, b))
            pos.append(self.positions[r])
        if noise:
            rms = pad.float().pow(2).mean(-1, keepdim=True).sqrt()
            pad = (pad.float() + (torch.rand(pad.shape, generator=generator) * 2 - 1) * (noise * rms)).to(pad.dtype)
        return torch.cat(rows), (pad, torch.cat(b_of), torch.cat(pos))

    def window_order(self, m: int, per_batch: int, seed: int, rank: int = 0, world: int = 1) -> list[int]:
        """The windows of micro-batch ``m`` of process ``rank``: a seeded permutation per epoch."""
        return self._shuffled(len(self.windows), m, per_batch, seed, rank, world).tolist()

    def _shuffled(self, n: int, m: int, per_batch: int, seed: int, rank: int, world: int) -> torch.Tensor:
        """Slice ``m * world + rank`` of a seeded permutation of range(n), a new one every epoch."""
        epoch, i = divmod(m * world + rank, math.ceil(n / per_batch))
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(n, generator=g))
        return self._perm[1][i * per_batch:(i + 1) * per_batch]

    def __len__(self) -> int:
        return self.hidden.shape[0]

    @classmethod
    @torch.no_grad()
    def build(cls, items: list[tuple[list[int], list[bool]]], num_heads: int, trainable: "Trainable", device,
              max_tokens: int = 4096, desc: str = "features", progress: bool = True,
              keep_windows: bool = False) -> "FeatureTable":
        """Run the backbone over ``items`` (windows, sorted by length into batches of about
        ``max_tokens`` tokens so little is spent on padding). ``keep_windows``: keep every window's
        states too (heads with a context layer)."""
        from tqdm.auto import tqdm

        order = sorted(range(len(items)), key=lambda j: len(items[j][0]))
        groups, cur = [], []
        for j in order:
            if cur and (len(cur) + 1) * len(items[j][0]) > max_tokens:
                groups.append(cur)
                cur = []
            cur.append(j)
        if cur:
            groups.append(cur)
        hs, ts, ins, nxt = [], [], [], []
        wins, starts, poss = [None] * len(items), [0] * len(items), [None] * len(items)  # by window
        base = 0  # rows so far
        for g in tqdm(groups, desc=desc, unit="batch", disable=not progress):
            ids, attn, mask = collate([items[j] for j in g])
            hidden = trainable.backbone(ids.to(device), attn.to(device)).cpu()  # (B, T, H)
            for r, j in enumerate(g):
                n = len(items[j][0])
                tgt = row_targets(ids[r, :n], mask[r, :n], num_heads)  # (n, K)
                keep = (tgt >= 0).any(-1)
                hs.append(hidden[r, :n][keep].clone())
                ts.append(tgt[keep])
                ins.append(row_inputs(ids[r, :n], num_heads)[keep])
                row_of = torch.full((n + num_heads + 1,), -1, dtype=torch.long)  # position -> row (kept ones)
                row_of[:n][keep] = base + torch.arange(int(keep.sum()))
                pos = torch.arange(n)[keep]
                nxt.append(row_of[pos[:, None] + torch.arange(1, num_heads + 1)[None]])  # (kept, K)
                wins[j], starts[j], poss[j] = hidden[r, :n].clone() if keep_windows else None, base, pos
                base += int(keep.sum())
        H = trainable.heads.config.hidden_size
        if not hs:
            empty = torch.zeros(0, num_heads, dtype=torch.long)
            return cls(torch.zeros(0, H), empty, empty.clone(), empty.clone())
        extra = ()
        if keep_windows:  # rows were appended group by group: put the windows in row order
            order = sorted(range(len(items)), key=lambda j: starts[j])
            counts = [len(poss[j]) for j in order]
            extra = ([wins[j] for j in order], torch.tensor([0] + counts).cumsum(0),
                     torch.cat([poss[j] for j in order]))
        return cls(torch.cat(hs), torch.cat(ts), torch.cat(ins), torch.cat(nxt), *extra)

    def rows(self, m: int, per_batch: int, seed: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        """Row indices of micro-batch ``m`` of process ``rank``: a seeded permutation per epoch."""
        return self._shuffled(len(self), m, per_batch, seed, rank, world)



def feature_loss(states: torch.Tensor, table: FeatureTable, rows: torch.Tensor, lam: float, device,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_d λ^d · smooth-L1(s_d, h_{t+d}) over the rows whose position t+d has a hidden state in the
    table: states (K, n, H) of sequential heads at the table's ``rows`` (n,). ``scale`` (K,):
    multiplies depth d's term (a process's share of a batch split across processes, as in
    ``losses.medusa_loss``)."""
    nxt = table.next_rows[rows]  # (n, K)
    loss = states.new_zeros((), dtype=torch.float32)
    for d in range(states.shape[0]):
        ok = nxt[:, d] >= 0
        if bool(ok.any()):
            want = table.hidden[nxt[ok, d]].to(device=device, dtype=torch.float32)
            term = F.smooth_l1_loss(states[d][ok.to(device)].float(), want)
            loss = loss + lam ** d * (term if scale is None else term * scale[d])
    return loss


def teacher_loss(head_logits: torch.Tensor, table: FeatureTable, rows: torch.Tensor, project, lam: float,
                 device, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k λ^k · CE(softmax(z), head_k) over the rows whose predicted position has a hidden state in
    the table: head_logits (K, n, V') at the table's ``rows`` (n,); ``project`` maps the target's
    hidden states (m, H) to its logits (m, V') over the same V' tokens. Head k at position t
    predicts token t+k+2, which the target's output at position t+k+1 (``next_rows[:, k]``) scores.
    ``scale`` (K,) as in :func:`feature_loss`."""
    nxt = table.next_rows[rows]  # (n, K)
    ok = nxt >= 0  # (n, K)
    with torch.no_grad():  # one projection for every head's teacher rows
        soft = project(table.hidden[nxt.T[ok.T]].to(device)).float().softmax(-1)  # (Σ_k m_k, V')
    loss = head_logits.new_zeros((), dtype=torch.float32)
    start = 0
    for k in range(head_logits.shape[0]):
        m = int(ok[:, k].sum())
        if m:
            term = F.cross_entropy(head_logits[k][ok[:, k].to(device)].float(), soft[start:start + m])
            loss = loss + lam ** k * (term if scale is None else term * scale[k])
        start += m
    return loss


def feature_tables(train: list, held: list, num_heads: int, trainable: Trainable, device, *, key: list,
                   cache_dir: str | None, keep_windows: bool, progress: bool,
                   main_process: bool) -> tuple[FeatureTable, FeatureTable]:
    """The tables of the training and held-out windows: read from ``cache_dir`` when an earlier run
    kept them under the same ``key`` (a JSON list naming the records, split, windows, K and
    backbone), else built by running the backbone (and kept there by the main process)."""
    cache = None
    if cache_dir:
        digest = hashlib.sha256(json.dumps(key + (["windows"] if keep_windows else [])).encode()).hexdigest()[:16]
        cache = Path(cache_dir) / f"features-{digest}.pt"
    if cache is not None and cache.is_file():
        saved = torch.load(cache, weights_only=True)
        return FeatureTable(*saved["train"]), FeatureTable(*saved["held"])
    tables = tuple(FeatureTable.build(items, num_heads, trainable, device, desc=f"backbone features ({what})",
                                      progress=progress, keep_windows=keep_windows)
                   for items, what in ((train, "train"), (held, "held out")))
    if cache is not None and main_process:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        torch.save({k: t.saved() for k, t in zip(("train", "held"), tables)}, tmp)
        os.replace(tmp, cache)  # appears whole
    return tables
