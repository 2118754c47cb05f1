"""Train Medusa heads on self-distilled data (``data.distill``), on ``accelerate``.

Medusa-1 (``mode="medusa1"``): the backbone is frozen; its final (normed) hidden states
h (B, T, H) are computed under ``torch.no_grad`` and only the heads learn, with
``losses.medusa_loss`` (Σ_k λ^k CE_k). The heads are exactly right for the original target.

Medusa-2 (``mode="medusa2"``): LoRA adapters (``peft``, all linear layers of the backbone but the
output layer) learn together with the heads, with ``losses.combined_loss`` (CE_lm + w·Medusa-1),
``lr_heads`` > ``lr_backbone``, after a heads-only warm-up of ``warmup_heads_steps`` steps (the
adapters start at zero, so the warm-up is Medusa-1). Caveat: Medusa-2 changes the backbone. As in
the Medusa paper, the intended model is then the *adapted* one (``out_dir/lora_adapter`` + heads):
lossless decoding with respect to the adapted model, whose outputs may differ from the original's.
Speculant decodes the ORIGINAL target losslessly, so the heads saved in ``out_dir`` are used with
the original, unadapted target: still lossless (the target verifies every token), but the heads
were trained on the adapted hidden states, so their acceptance can be lower than Medusa-1 heads';
the report's ``final_original_target`` measures exactly that. The caller's model is restored
(``unload``) when training ends; its weights are never modified.

Outputs (``out_dir``): the heads in the Medusa layout (``config.json``, ``model.safetensors``),
``training_report.json`` (held-out loss and per-head top-1/top-5 before and after training),
``held_out.jsonl`` (the held-out records: calibration data for ``accuracy.build_tree``),
``lora_adapter/`` (Medusa-2), and ``checkpoints/step-XXXXXXXX/`` (``heads/``, ``lora/``,
``state.pt``: optimizer, scheduler, step) to resume from; a checkpoint directory appears whole
(renamed into place once written).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..models import LoadedModel
from ..packing import unpack_linears
from ..heads import HeadsConfig, MedusaHeads, SequentialHeads, load_heads, make_heads, save_heads
from .data import Batches, collate, load_records, windows
from .losses import combined_loss, head_valid_counts, lm_loss, medusa_loss, medusa_loss_rows, row_inputs, row_targets

__all__ = ["TrainConfig", "train_heads"]


@dataclass(frozen=True)
class TrainConfig:
    """steps: optimizer steps (None: ``epochs`` passes over the training windows). batch_size:
    windows of ``seq_len`` tokens per micro-batch per process; ``grad_accum`` micro-batches per
    step. stop_after: end this run (with a checkpoint) at that step; run again to resume."""

    mode: str = "medusa1"
    steps: int | None = None
    epochs: float = 1.0
    batch_size: int = 4
    grad_accum: int = 1
    seq_len: int = 512
    lr_heads: float = 1e-3
    lr_context: float | None = None  # sequential heads' context layer (None: lr_heads)
    lr_backbone: float = 1e-4
    lr_warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    lam: float = 0.8
    heads_weight: float = 0.2
    warmup_heads_steps: int = 0
    lora_r: int = 16
    lora_alpha: int = 32
    held_out_fraction: float = 0.05
    train_on_prompt: bool = False
    save_every: int = 200
    keep_checkpoints: int = 2
    resume: bool = True
    seed: int = 0
    stop_after: int | None = None
    progress: bool = True
    cache_features: bool = True  # medusa1: train on a table of the frozen backbone's hidden states
    rows_per_batch: int = 512  # medusa1 with cache_features: positions per micro-batch (batch_size is unused)
    # "full": cross-entropy over the whole vocabulary; "data": over the tokens that occur in the
    # training records only (~20x cheaper for a 152k vocabulary; shared projection + feature table
    # only). Held-out metrics are always over the whole vocabulary.
    train_vocab: str = "full"
    # sequential heads: weight w of an EAGLE-style feature loss, Σ_d λ^d · w · smooth-L1(s_d, h_{t+d}),
    # pulling each step's state onto the target's own hidden state at that position (0: off)
    feature_weight: float = 0.0
    # weight w of a soft-label (teacher) loss, Σ_k λ^k · w · CE(softmax(z_{t+k+1}), head_k), z the
    # target's own logits at the position head k predicts for (Hydra++'s teacher distillation; the
    # hard labels are the target's greedy tokens, the soft ones also rank its alternatives, which a
    # tree drafts). Needs the feature table, which holds the target's hidden states (0: off)
    teacher_weight: float = 0.0
    # medusa1 feature table: a directory where the frozen backbone's tables are kept and reused by
    # later runs on the same data, split, window length, K and backbone (None: not kept)
    feature_cache: str | None = None
    # medusa1 feature table: uniform noise U(-a, a) times each row's RMS added to the hidden states
    # the heads read in training (EAGLE's robustness trick; 0: off)
    feature_noise: float = 0.0
    # held-out metrics every this many steps into the report's "history" (0: only first and last)
    eval_every: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("medusa1", "medusa2"):
            raise ConfigError(f"training mode must be medusa1 or medusa2, got {self.mode!r}")
        if self.feature_noise < 0 or self.eval_every < 0 or self.weight_decay < 0:
            raise ConfigError("feature_noise, eval_every and weight_decay must be >= 0, got "
                              f"{self.feature_noise}, {self.eval_every}, {self.weight_decay}")
        if self.feature_weight < 0 or self.teacher_weight < 0:
            raise ConfigError(f"feature_weight and teacher_weight must be >= 0, got {self.feature_weight}, "
                              f"{self.teacher_weight}")
        if self.train_vocab not in ("full", "data"):
            raise ConfigError(f"train_vocab must be 'full' or 'data', got {self.train_vocab!r}")
        for name in ("batch_size", "grad_accum", "seq_len", "save_every", "keep_checkpoints", "lora_r"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 3:
            raise ConfigError("seq_len must be >= 3 (head 0 predicts two tokens ahead)")
        if not 0 <= self.held_out_fraction < 1:
            raise ConfigError(f"held_out_fraction must be in [0, 1), got {self.held_out_fraction}")
        if (self.steps is not None and self.steps < 1) or self.epochs <= 0:
            raise ConfigError("steps must be >= 1 (or None) and epochs > 0")


class _Trainable(nn.Module):
    """Backbone + heads: ``forward(ids, attn, joint, hidden) -> (lm_logits (B, T, V) | None, heads (K, B, T, V))``.
    Without ``joint`` the backbone runs under no_grad (Medusa-1, and Medusa-2's warm-up); a given
    ``hidden`` (B, T, H) (the frozen backbone's, from a :class:`_FeatureStore`) skips the backbone."""

    def __init__(self, model: nn.Module, heads: MedusaHeads | SequentialHeads):
        super().__init__()
        self.model, self.heads = model, heads

    def forward(self, ids: torch.Tensor, attn: torch.Tensor, joint: bool = False, hidden: torch.Tensor | None = None,
                tokens: torch.Tensor | None = None, vocab: torch.Tensor | None = None, want_states: bool = False,
                seq: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """``tokens`` (n, K): the inputs of sequential heads (``_FeatureTable.inputs``); ``vocab``
        (V',): score only these tokens (``TrainConfig.train_vocab``). ``want_states`` (sequential
        heads): also return their states (K, n, H), as a third value. ``seq`` (heads with a context
        layer, instead of ``hidden``): windows of backbone states (B, T, H) and the (window, position)
        (n,), (n,) of each row (``_FeatureTable.window_batch``)."""
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


class _FeatureTable:
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

    def window_batch(self, ws: Sequence[int], noise: float = 0.0) -> tuple[torch.Tensor, tuple]:
        """Windows ``ws`` -> (their rows (n,), ``seq`` for ``_Trainable``: the windows' states padded
        on the right (B, T, H), with ``noise`` as in ``TrainConfig.feature_noise``, and each row's
        (window in the batch, position))."""
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
            pad = (pad.float() + (torch.rand(pad.shape) * 2 - 1) * (noise * rms)).to(pad.dtype)
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
    def build(cls, items: list[tuple[list[int], list[bool]]], num_heads: int, trainable: "_Trainable", device,
              max_tokens: int = 4096, desc: str = "features", progress: bool = True,
              keep_windows: bool = False) -> "_FeatureTable":
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


@torch.no_grad()
def _evaluate(trainable: _Trainable, batches: list[list[int]], items: list, cfg: TrainConfig,
              device, joint: bool, table: _FeatureTable | None = None) -> dict:
    """Held-out metrics over ``items`` (windows) in ``batches`` (lists of window indices), or over
    the rows of ``table``, weighted by the number of counted (position, head) pairs."""
    K = trainable.heads.num_heads
    loss_s, top1_s, top5_s, n_s = (torch.zeros(K, dtype=torch.float64) for _ in range(4))
    lm_s, lm_n = 0.0, 0
    if table is not None and not joint:
        if table.windows is not None:  # a context layer: whole windows, then their rows
            chunks = (table.window_batch(range(a, min(a + cfg.batch_size, len(table.windows))))
                      for a in range(0, len(table.windows), cfg.batch_size))
        else:
            chunks = ((torch.arange(a, min(a + cfg.rows_per_batch, len(table))), None)
                      for a in range(0, len(table), cfg.rows_per_batch))
        for rows, seq in chunks:
            h = None if seq is not None else table.hidden[rows].to(device)
            seq = None if seq is None else tuple(t.to(device) for t in seq)
            _, hl = trainable(None, None, hidden=h, tokens=table.inputs[rows].to(device), seq=seq)
            _, per, t1, t5, n = medusa_loss_rows(hl, table.targets[rows].to(device), cfg.lam, top5=True)
            n = n.double()
            loss_s += per.double() * n; top1_s += t1.double() * n; top5_s += t5.double() * n; n_s += n
    else:
        for idx in batches:
            ids, attn, mask = (t.to(device) for t in collate([items[j] for j in idx]))
            lm, hl = trainable(ids, attn, joint=joint)
            _, per, t1, t5 = medusa_loss(hl, ids, mask, cfg.lam)
            n = head_valid_counts(mask, K).cpu().double()
            loss_s += per.double() * n; top1_s += t1.double() * n; top5_s += t5.double() * n; n_s += n
            if lm is not None:
                lm_s += float(lm_loss(lm, ids, mask)) * int(mask[:, 1:].sum()); lm_n += int(mask[:, 1:].sum())
    n_s = n_s.clamp(min=1)
    per_loss = (loss_s / n_s).tolist()
    out = {"loss": sum(cfg.lam ** k * per_loss[k] for k in range(K)), "per_head_loss": per_loss,
           "top1": (top1_s / n_s).tolist(), "top5": (top5_s / n_s).tolist(), "positions": n_s.long().tolist()}
    if lm_n:
        out["lm_loss"] = lm_s / lm_n
    return out


def draft_vocabulary(records: Sequence[dict], n: int, vocab_size: int) -> torch.Tensor:
    """The ``n`` token ids sequential heads may propose: the answer tokens of ``records`` by
    decreasing frequency, then the lowest ids not taken yet (byte-level BPE vocabularies number
    tokens in merge order, so low ids are the frequent ones). Sorted (n,) long."""
    from collections import Counter

    counts = Counter(t for r in records for t in r["ids"][r["prompt_len"]:] if 0 <= t < vocab_size)
    chosen = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]
    taken = set(chosen)
    fill = (i for i in range(vocab_size) if i not in taken)
    chosen += [next(fill) for _ in range(n - len(chosen))]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def feature_loss(states: torch.Tensor, table: _FeatureTable, rows: torch.Tensor, lam: float, device) -> torch.Tensor:
    """Σ_d λ^d · smooth-L1(s_d, h_{t+d}) over the rows whose position t+d has a hidden state in the
    table: states (K, n, H) of sequential heads at the table's ``rows`` (n,)."""
    nxt = table.next_rows[rows]  # (n, K)
    loss = states.new_zeros((), dtype=torch.float32)
    for d in range(states.shape[0]):
        ok = nxt[:, d] >= 0
        if bool(ok.any()):
            want = table.hidden[nxt[ok, d]].to(device=device, dtype=torch.float32)
            loss = loss + lam ** d * F.smooth_l1_loss(states[d][ok.to(device)].float(), want)
    return loss


def teacher_loss(head_logits: torch.Tensor, table: _FeatureTable, rows: torch.Tensor, project, lam: float,
                 device) -> torch.Tensor:
    """Σ_k λ^k · CE(softmax(z), head_k) over the rows whose predicted position has a hidden state in
    the table: head_logits (K, n, V') at the table's ``rows`` (n,); ``project`` maps the target's
    hidden states (m, H) to its logits (m, V') over the same V' tokens. Head k at position t
    predicts token t+k+2, which the target's output at position t+k+1 (``next_rows[:, k]``) scores."""
    nxt = table.next_rows[rows]  # (n, K)
    ok = nxt >= 0  # (n, K)
    with torch.no_grad():  # one projection for every head's teacher rows
        soft = project(table.hidden[nxt.T[ok.T]].to(device)).float().softmax(-1)  # (Σ_k m_k, V')
    loss = head_logits.new_zeros((), dtype=torch.float32)
    start = 0
    for k in range(head_logits.shape[0]):
        m = int(ok[:, k].sum())
        if m:
            loss = loss + lam ** k * F.cross_entropy(head_logits[k][ok[:, k].to(device)].float(),
                                                     soft[start:start + m])
        start += m
    return loss


def _lr_lambda(total: int, warmup: int, start: int = 0):
    """0 before ``start``, then a linear warm-up of ``warmup`` steps and a cosine decay to 0."""
    def f(step: int) -> float:
        s, n = step - start, max(1, total - start)
        if s < 0:
            return 0.0
        if s < warmup:
            return (s + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, n - warmup))))
    return f


def _latest(ckpt_root: Path) -> Path | None:
    done = sorted(p for p in ckpt_root.glob("step-*") if (p / "state.pt").is_file())
    return done[-1] if done else None


def _save(ckpt_root: Path, step: int, heads: MedusaHeads | SequentialHeads, peft_model, state: dict, keep: int) -> None:
    final, tmp = ckpt_root / f"step-{step:08d}", ckpt_root / f".tmp-step-{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_heads(heads, tmp / "heads")
    if peft_model is not None:
        peft_model.save_pretrained(str(tmp / "lora"))
    torch.save(state, tmp / "state.pt")  # written last: its presence marks a whole checkpoint
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(p for p in ckpt_root.glob("step-*") if (p / "state.pt").is_file())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def train_heads(target, heads_cfg: HeadsConfig, data_path: str | os.PathLike | Sequence[str | os.PathLike],
                out_dir: str | os.PathLike, cfg: TrainConfig | None = None, *, accelerator=None,
                init_from: str | os.PathLike | None = None, **overrides) -> dict:
    """Train ``heads_cfg`` heads for ``target`` (a ``LoadedModel`` or transformers causal LM) on the
    distillation JSONL ``data_path`` (one path or several, concatenated); write heads, report and
    checkpoints to ``out_dir``. ``init_from``: a heads directory (Medusa layout, same configuration)
    whose weights the heads start from instead of a fresh initialisation (fine-tuning on new data).

    ``cfg`` fields may be given as keyword arguments (``train_heads(..., mode="medusa2", steps=100)``).
    Returns the report (also ``out_dir/training_report.json``).
    """
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from safetensors.torch import load_file
    from tqdm.auto import tqdm

    cfg = dataclasses.replace(cfg or TrainConfig(), **overrides)
    model = target.model if isinstance(target, LoadedModel) else target
    unpack_linears(model)  # nn.Linear layers for LoRA and autograd (a decoder's HFBackend packs them)
    out, t0 = Path(out_dir), time.perf_counter()
    ckpt_root = out / "checkpoints"
    paths = [Path(data_path)] if isinstance(data_path, (str, os.PathLike)) else [Path(p) for p in data_path]
    records = [r for p in paths for r in load_records(p)]
    data_sha256 = [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]  # resume fingerprint, feature cache key
    if len(records) < 1:
        raise ConfigError(f"no training records in {', '.join(map(str, paths))}: make them first "
                          "(speculant.training.data.distill)")
    perm = torch.randperm(len(records), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    n_held = min(len(records) - 1, math.ceil(cfg.held_out_fraction * len(records))) if cfg.held_out_fraction else 0
    held = windows([records[i] for i in perm[:n_held]], cfg.seq_len, cfg.train_on_prompt)
    train = windows([records[i] for i in perm[n_held:]], cfg.seq_len, cfg.train_on_prompt)
    if not train:
        raise ConfigError(f"{', '.join(map(str, paths))} yields no training window (answers of >= 3 tokens needed)")
    if accelerator is None:
        kw = [DistributedDataParallelKwargs(find_unused_parameters=True)] if cfg.mode == "medusa2" else []
        accelerator = Accelerator(kwargs_handlers=kw)
    world, rank = accelerator.num_processes, accelerator.process_index
    flat = cfg.cache_features and cfg.mode == "medusa1"
    if heads_cfg.kind == "sequential" and not flat:
        raise ConfigError("sequential heads train on the frozen backbone's features only: use mode medusa1 "
                          "with cache_features (the defaults)")
    if cfg.feature_weight and heads_cfg.kind != "sequential":
        raise ConfigError("feature_weight is a loss on the states of sequential heads: use kind='sequential' "
                          "(--head-kind sequential) or feature_weight=0")
    if cfg.teacher_weight and not flat:
        raise ConfigError("teacher_weight scores the target's own logits from the feature table: use mode medusa1 "
                          "with cache_features (the defaults), or teacher_weight=0")
    if cfg.feature_noise and not flat:
        raise ConfigError("feature_noise perturbs the rows of the feature table: use mode medusa1 with "
                          "cache_features (the defaults), or feature_noise=0")
    vocab = remap = None
    if cfg.train_vocab == "data":
        if not (flat and heads_cfg.shared_lm_head):
            raise ConfigError("train_vocab='data' needs the feature table (mode medusa1, cache_features) and heads "
                              "that project through the shared output layer")
        vocab = torch.tensor(sorted({t for r in records for t in r["ids"]}), dtype=torch.long)
        if int(vocab[-1]) >= heads_cfg.vocab_size:
            raise ConfigError(f"the records hold token {int(vocab[-1])}, outside the {heads_cfg.vocab_size}-token vocabulary")
        remap = torch.full((heads_cfg.vocab_size + 1,), -1, dtype=torch.long)  # remap[-1] == -1: no target
        remap[vocab] = torch.arange(len(vocab))
    torch.manual_seed(cfg.seed)
    heads = make_heads(heads_cfg, model).float()
    teacher_project = None
    if cfg.teacher_weight:  # the target's frozen output layer, cut to the trained vocabulary once, not every step
        out_layer = model.get_output_embeddings()
        t_weight = out_layer.weight.detach()
        t_bias = out_layer.bias.detach() if getattr(out_layer, "bias", None) is not None else None
        if vocab is not None:
            t_weight, t_bias = t_weight[vocab], (t_bias[vocab] if t_bias is not None else None)

        def teacher_project(h: torch.Tensor) -> torch.Tensor:  # (m, H) -> (m, V') target logits
            return F.linear(h.to(t_weight.dtype), t_weight, t_bias)
    if init_from is not None:
        start = load_heads(init_from, model, dtype=torch.float32)
        shape = dataclasses.replace(start.config, base_model=heads_cfg.base_model)
        # heads without a context layer may start heads with one (the new layer starts as the identity)
        if shape != heads_cfg and shape != dataclasses.replace(heads_cfg, context_size=0):
            raise ConfigError(f"--init-from {init_from}: its heads ({shape}) are not the ones being trained "
                              f"({heads_cfg}); match --num-heads, --num-layers, --head-kind, --per-head-projection "
                              "and --context-layer")
        state = start.medusa_state_dict()
        if shape.context_size == heads_cfg.context_size:
            heads.load_weights(state)
        else:
            heads.load_state_dict(state, strict=False)  # everything but context.*, checked just above
    if heads_cfg.draft_vocab:
        heads.set_draft_vocab(draft_vocabulary([records[i] for i in perm[n_held:]], heads_cfg.draft_vocab,
                                               heads_cfg.vocab_size))
    train_table = held_table = None
    if flat:  # the frozen backbone runs once, here; training then reads the table
        feat = _Trainable(model, heads).to(accelerator.device)
        show = cfg.progress and accelerator.is_local_main_process
        cache = None
        with_windows = bool(heads_cfg.context_size)
        if cfg.feature_cache:  # same records, split, windows, K and backbone: the same tables
            key = hashlib.sha256(json.dumps([data_sha256,
                                             cfg.seed, cfg.held_out_fraction, cfg.seq_len, cfg.train_on_prompt,
                                             heads_cfg.num_heads, heads_cfg.base_model, heads_cfg.hidden_size,
                                             str(next(model.parameters()).dtype)]
                                            + (["windows"] if with_windows else [])).encode()).hexdigest()[:16]
            cache = Path(cfg.feature_cache) / f"features-{key}.pt"
        if cache is not None and cache.is_file():
            saved = torch.load(cache, weights_only=True)
            train_table, held_table = (_FeatureTable(*saved[k]) for k in ("train", "held"))
        else:
            train_table = _FeatureTable.build(train, heads_cfg.num_heads, feat, accelerator.device,
                                              desc="backbone features (train)", progress=show,
                                              keep_windows=with_windows)
            held_table = _FeatureTable.build(held, heads_cfg.num_heads, feat, accelerator.device,
                                             desc="backbone features (held out)", progress=show,
                                             keep_windows=with_windows)
            if cache is not None and accelerator.is_main_process:
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_suffix(".tmp")
                torch.save({k: t.saved() for k, t in (("train", train_table), ("held", held_table))}, tmp)
                os.replace(tmp, cache)  # appears whole
        per_epoch = math.ceil((len(train_table.windows) / cfg.batch_size) if with_windows
                              else len(train_table) / cfg.rows_per_batch)
    else:
        batches = Batches(train, cfg.batch_size, cfg.seed, rank, world)
        per_epoch = batches.per_epoch
    total = cfg.steps or max(1, math.ceil(cfg.epochs * per_epoch / (world * cfg.grad_accum)))
    fingerprint = {"mode": cfg.mode, "heads": heads_cfg.to_json(), "seed": cfg.seed, "steps": total,
                   "batch_size": cfg.rows_per_batch if flat and not heads_cfg.context_size else cfg.batch_size,
                   "flat": flat, "lr_context": cfg.lr_context,
                   "train_vocab": cfg.train_vocab, "feature_weight": cfg.feature_weight, "feature_noise": cfg.feature_noise,
                   "teacher_weight": cfg.teacher_weight,
                   "weight_decay": cfg.weight_decay,
                   "grad_accum": cfg.grad_accum, "seq_len": cfg.seq_len,
                   "world": world, "data_sha256": data_sha256,
                   "init_from": str(init_from) if init_from is not None else None}
    if accelerator.is_main_process:
        if not cfg.resume:
            shutil.rmtree(ckpt_root, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)  # the held-out records: calibration data for build_tree
        (out / "held_out.jsonl").write_text("".join(json.dumps(records[i], ensure_ascii=False) + "\n"
                                                    for i in perm[:n_held]), encoding="utf-8")

    peft_model = None
    if cfg.mode == "medusa2":
        from peft import LoraConfig, get_peft_model
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules="all-linear")
        peft_model = get_peft_model(model, lora)  # injects LoRA layers into `model` in place
    try:
        trainable = _Trainable(model, heads)
        context = getattr(heads, "context", None)  # sequential heads' context layer: its own learning rate
        in_context = {id(p) for p in context.parameters()} if context is not None else set()
        groups = [{"params": [p for p in heads.parameters() if id(p) not in in_context], "lr": cfg.lr_heads}]
        lambdas = [_lr_lambda(total, cfg.lr_warmup_steps)]
        if context is not None:
            groups.append({"params": list(context.parameters()), "lr": cfg.lr_context or cfg.lr_heads})
            lambdas.append(_lr_lambda(total, cfg.lr_warmup_steps))
        if peft_model is not None:
            groups.append({"params": [p for p in model.parameters() if p.requires_grad], "lr": cfg.lr_backbone})
            lambdas.append(_lr_lambda(total, cfg.lr_warmup_steps, cfg.warmup_heads_steps))
        optimizer = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
        trainable, optimizer = accelerator.prepare(trainable, optimizer)
        core = accelerator.unwrap_model(trainable)
        device = accelerator.device
        held_batches = [list(range(i, min(i + cfg.batch_size, len(held)))) for i in range(0, len(held), cfg.batch_size)]

        step, initial, resumed_from = 0, None, None
        latest = _latest(ckpt_root) if cfg.resume else None
        if latest is not None:
            state = torch.load(latest / "state.pt", weights_only=True)
            if state["fingerprint"] != fingerprint:
                diff = sorted(k for k in fingerprint if state["fingerprint"].get(k) != fingerprint[k])
                raise ConfigError(f"cannot resume from {latest}: it was made with other settings ({', '.join(diff)}); "
                                  "use another output directory, or resume=False (--no-resume) to start over")
            core.heads.load_weights(load_file(str(latest / "heads" / "model.safetensors")))
            if peft_model is not None:
                from peft import set_peft_model_state_dict
                set_peft_model_state_dict(peft_model, load_file(str(latest / "lora" / "adapter_model.safetensors")))
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            step, initial = int(state["step"]), state["initial"]
            resumed_from = step
        if initial is None:
            initial = _evaluate(core, held_batches, held, cfg, device, False, held_table) if held_batches else {}

        history = list(state.get("history", [])) if latest is not None else []
        params = [p for g in optimizer.param_groups for p in g["params"]]
        bar = tqdm(total=total, initial=step, desc=f"train-heads ({cfg.mode})", unit="step",
                   disable=not (cfg.progress and accelerator.is_local_main_process))
        stop = min(total, cfg.stop_after) if cfg.stop_after else total
        while step < stop:
            joint = peft_model is not None and step >= cfg.warmup_heads_steps
            optimizer.zero_grad(set_to_none=True)
            for a in range(cfg.grad_accum):
                m = step * cfg.grad_accum + a
                sync = contextlib.nullcontext() if a == cfg.grad_accum - 1 else accelerator.no_sync(trainable)
                with sync:
                    if train_table is not None:
                        hidden = seq = None
                        if train_table.windows is not None:  # a context layer: whole windows
                            rows, seq = train_table.window_batch(
                                train_table.window_order(m, cfg.batch_size, cfg.seed, rank, world), cfg.feature_noise)
                            seq = tuple(t.to(device) for t in seq)
                        else:
                            rows = train_table.rows(m, cfg.rows_per_batch, cfg.seed, rank, world)
                            hidden = train_table.hidden[rows].to(device)
                        if cfg.feature_noise and hidden is not None:
                            rms = hidden.float().pow(2).mean(-1, keepdim=True).sqrt()
                            noise = (torch.rand(hidden.shape, device=device) * 2 - 1) * (cfg.feature_noise * rms)
                            hidden = (hidden.float() + noise).to(hidden.dtype)
                        res = trainable(None, None, hidden=hidden, seq=seq,
                                        tokens=train_table.inputs[rows].to(device),
                                        vocab=vocab.to(device) if vocab is not None else None,
                                        want_states=bool(cfg.feature_weight))
                        hl = res[1]
                        targets = train_table.targets[rows] if remap is None else remap[train_table.targets[rows]]
                        loss, per, t1, _, _ = medusa_loss_rows(hl, targets.to(device), cfg.lam)
                        if cfg.feature_weight:
                            loss = loss + cfg.feature_weight * feature_loss(res[2], train_table, rows, cfg.lam, device)
                        if cfg.teacher_weight:
                            loss = loss + cfg.teacher_weight * teacher_loss(
                                hl, train_table, rows, teacher_project, cfg.lam, device)
                    else:
                        ids, attn, mask = (t.to(device) for t in batches[m])
                        lm, hl = trainable(ids, attn, joint=joint)
                        if joint:
                            loss, _, _, per, t1, _ = combined_loss(lm, hl, ids, mask, cfg.lam, cfg.heads_weight)
                        else:
                            loss, per, t1, _ = medusa_loss(hl, ids, mask, cfg.lam)
                    accelerator.backward(loss / cfg.grad_accum)
            if cfg.max_grad_norm:
                accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", top1=f"{float(t1[0]):.2f}", refresh=False)
            if cfg.eval_every and held_batches and step % cfg.eval_every == 0 and step < stop:
                ev = _evaluate(core, held_batches, held, cfg, device, peft_model is not None, held_table)
                history.append({"step": step, **ev})
                bar.write(f"step {step}: held-out loss {ev['loss']:.3f}, top-1 "
                          + " ".join(f"{x:.3f}" for x in ev["top1"]))
            if step % cfg.save_every == 0 or step == stop:
                if accelerator.is_main_process:
                    state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                             "fingerprint": fingerprint, "initial": initial, "history": history}
                    _save(ckpt_root, step, core.heads, peft_model, state, cfg.keep_checkpoints)
                accelerator.wait_for_everyone()
        bar.close()

        report = {"mode": cfg.mode, "step": step, "total_steps": total, "finished": step >= total,
                  "resumed_from": resumed_from,
                  "train_rows": len(train_table) if train_table is not None else None,
                  "train_vocab_size": len(vocab) if vocab is not None else heads_cfg.vocab_size,
                  "train_windows": len(train), "held_out_windows": len(held), "processes": world,
                  "seconds_this_run": round(time.perf_counter() - t0, 1), "initial": initial,
                  "config": dataclasses.asdict(cfg), "heads": heads_cfg.to_json()}
        if held_batches:
            report["final"] = _evaluate(core, held_batches, held, cfg, device, peft_model is not None, held_table)
            report["history"] = history + [{"step": step, **report["final"]}]
            if peft_model is not None:
                with peft_model.disable_adapter():  # what the heads do for the ORIGINAL target
                    report["final_original_target"] = _evaluate(core, held_batches, held, cfg, device, False)
        if accelerator.is_main_process:
            save_heads(core.heads, out)
            if peft_model is not None:
                peft_model.save_pretrained(str(out / "lora_adapter"))
                report["note"] = ("medusa2: lora_adapter + heads is the Medusa-2 model (lossless w.r.t. the adapted "
                                  "backbone); the heads alone, used with the original target, decode losslessly "
                                  "but were trained on adapted hidden states: see final_original_target")
            (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
        accelerator.wait_for_everyone()
        return report
    finally:
        if peft_model is not None:
            peft_model.unload()  # the caller's model gets its original modules back (weights untouched)
