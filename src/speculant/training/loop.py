"""The third stage of head training (``train.train_heads``): the optimizer steps and the held-out
evaluation (the checkpoints a run writes and resumes from: ``checkpoints``).

A micro-batch is either rows of the frozen backbone's feature table (Medusa-1 with
``cache_features``; whole windows for heads with a context layer) or windows of tokens the backbone
runs on (Medusa-2, or Medusa-1 without the table). Shapes: B windows of T tokens, n rows, K heads,
V (or V') tokens scored, H = hidden size.

Several processes (``accelerate launch``): process p of W takes global micro-batch ``m·W + p``
(``data.Batches``, ``FeatureTable.rows``), so W processes with ``batch_size`` b see, step by step,
the rows one process with W·b sees (within an epoch; when an epoch's rows are not a multiple of
W·b the epochs split differently). Every loss term is scaled by the process's share of the global
batch's counted pairs (``losses`` ``scale``), so the gradient data-parallel training averages is
the one of the whole global batch, and ``TrainRun.train_loss`` records that batch's loss. Held-out
batches are shared out among the processes and their sums added up.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .data import collate
from .features import FeatureTable, Trainable, feature_loss, teacher_loss
from .losses import combined_loss, head_valid_counts, lm_loss, medusa_loss, medusa_loss_rows

__all__ = ["TrainRun", "evaluate", "lr_lambda", "train_loop"]


@dataclass
class TrainRun:
    """Everything the loop reads and updates. ``trainable``: the model and heads as prepared by
    ``accelerator`` (maybe wrapped), ``core`` the unwrapped :class:`Trainable`; ``train_table`` /
    ``held_table``: the feature tables, or None (then ``batches`` holds the training windows);
    ``data``: a ``setup.TrainData``; ``held_batches``: lists of held-out window indices.
    ``step``, ``initial`` (held-out metrics before training), ``resumed_from`` and ``history``
    (metrics every ``cfg.eval_every`` steps) and ``train_loss`` (the global batch's training loss of
    every step so far, step 1 first) change as the run goes."""

    cfg: Any
    accelerator: Any
    trainable: torch.nn.Module
    core: Trainable
    optimizer: torch.optim.Optimizer
    scheduler: Any
    peft_model: Any
    data: Any
    train_table: FeatureTable | None
    held_table: FeatureTable | None
    batches: Any
    teacher_project: Callable[[torch.Tensor], torch.Tensor] | None
    total: int
    fingerprint: dict
    ckpt_root: Path
    held_batches: list[list[int]]
    step: int = 0
    initial: dict | None = None
    resumed_from: int | None = None
    history: list[dict] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)

    @property
    def stop(self) -> int:
        """The step this run ends at (``cfg.stop_after`` ends it early, to be resumed)."""
        return min(self.total, self.cfg.stop_after) if self.cfg.stop_after else self.total

    def evaluate(self, joint: bool | None = None, table: bool = True) -> dict:
        """Held-out metrics of the heads now (``joint``: with the adapters' LM loss; default: iff
        there are adapters)."""
        joint = self.peft_model is not None if joint is None else joint
        return evaluate(self.core, self.held_batches, self.data.held, self.cfg, self.accelerator.device, joint,
                        self.held_table if table else None, self.accelerator)


def train_loop(run: TrainRun) -> None:
    """Optimizer steps from ``run.step`` to ``run.stop``: ``cfg.grad_accum`` micro-batches each,
    held-out metrics every ``cfg.eval_every`` steps, a checkpoint every ``cfg.save_every`` and at the end
    (written by the main process only, the others waiting until it is in place)."""
    from tqdm.auto import tqdm

    from .checkpoints import save_checkpoint

    cfg, accelerator = run.cfg, run.accelerator
    params = [p for g in run.optimizer.param_groups for p in g["params"]]
    bar = tqdm(total=run.total, initial=run.step, desc=f"train-heads ({cfg.mode})", unit="step",
               disable=not (cfg.progress and accelerator.is_local_main_process))
    stop = run.stop
    while run.step < stop:
        joint = run.peft_model is not None and run.step >= cfg.warmup_heads_steps
        run.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), dtype=torch.float64)
        for a in range(cfg.grad_accum):
            last = a == cfg.grad_accum - 1
            with contextlib.nullcontext() if last else accelerator.no_sync(run.trainable):
                loss, t1 = micro_batch_loss(run, run.step * cfg.grad_accum + a, joint)
                accelerator.backward(loss / cfg.grad_accum)
            step_loss += float(loss.detach()) / cfg.grad_accum
        if accelerator.num_processes > 1:  # each process's loss is its share of the global batch's
            step_loss = accelerator.reduce(step_loss, "mean")
        run.train_loss.append(float(step_loss))
        if cfg.max_grad_norm:
            accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
        run.optimizer.step()
        run.scheduler.step()
        run.step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{run.train_loss[-1]:.3f}", top1=f"{float(t1[0]):.2f}", refresh=False)
        if cfg.eval_every and run.held_batches and run.step % cfg.eval_every == 0 and run.step < stop:
            ev = run.evaluate()
            run.history.append({"step": run.step, **ev})
            bar.write(f"step {run.step}: held-out loss {ev['loss']:.3f}, top-1 "
                      + " ".join(f"{x:.3f}" for x in ev["top1"]))
        if run.step % cfg.save_every == 0 or run.step == stop:
            if accelerator.is_main_process:
                state = {"step": run.step, "optimizer": run.optimizer.state_dict(),
                         "scheduler": run.scheduler.state_dict(), "fingerprint": run.fingerprint,
                         "initial": run.initial, "history": run.history, "train_loss": run.train_loss}
                path = save_checkpoint(run.ckpt_root, run.step, run.core.heads, run.peft_model, state,
                                       cfg.keep_checkpoints)
                if cfg.progress:
                    bar.write(f"speculant: checkpoint {path} (step {run.step})", file=sys.stderr)
            accelerator.wait_for_everyone()
    bar.close()


def micro_batch_loss(run: TrainRun, m: int, joint: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's part of the training loss of global micro-batch ``m`` (scaled so that the
    processes' mean is the whole batch's loss; see the module's docstring) and its per-head top-1 (K,)."""
    cfg, table, device = run.cfg, run.train_table, run.accelerator.device
    rank, world = run.accelerator.process_index, run.accelerator.num_processes
    K = run.core.heads.num_heads
    if table is None:  # windows of tokens through the backbone
        ids, attn, mask = (t.to(device) for t in run.batches[m])
        counts = head_valid_counts(mask, K).cpu()
        scale = shares(run.accelerator, torch.cat([counts, mask[:, 1:].sum().cpu()[None]]))
        lm, hl = run.trainable(ids, attn, joint=joint)
        heads_scale = None if scale is None else scale[:K].to(device)
        if joint:
            loss, _, _, _, t1, _ = combined_loss(lm, hl, ids, mask, cfg.lam, cfg.heads_weight, heads_scale,
                                                 1.0 if scale is None else float(scale[K]))
        else:
            loss, _, t1, _ = medusa_loss(hl, ids, mask, cfg.lam, heads_scale)
        return loss, t1
    hidden = seq = None
    noise = torch.Generator().manual_seed((cfg.seed * 1_000_003 + m) * 1_009 + rank) if cfg.feature_noise else None
    if table.windows is not None:  # a context layer: whole windows
        rows, seq = table.window_batch(table.window_order(m, cfg.batch_size, cfg.seed, rank, world), cfg.feature_noise,
                                       noise)
        seq = tuple(t.to(device) for t in seq)
    else:
        rows = table.rows(m, cfg.rows_per_batch, cfg.seed, rank, world)
        hidden = table.hidden[rows].to(device)  # (n, H)
    if cfg.feature_noise and hidden is not None:
        rms = hidden.float().pow(2).mean(-1, keepdim=True).sqrt()
        u = torch.rand(hidden.shape, generator=noise).to(device)
        hidden = (hidden.float() + (u * 2 - 1) * (cfg.feature_noise * rms)).to(hidden.dtype)
    vocab, remap = run.data.vocab, run.data.remap
    targets = table.targets[rows] if remap is None else remap[table.targets[rows]]
    # counted pairs of each head, and rows whose position t+k+1 has a state (feature, teacher losses)
    scale = shares(run.accelerator, torch.cat([(targets >= 0).sum(0), (table.next_rows[rows] >= 0).sum(0)]))
    scale = None if scale is None else scale.to(device)
    res = run.trainable(None, None, hidden=hidden, seq=seq, tokens=table.inputs[rows].to(device),
                        vocab=vocab.to(device) if vocab is not None else None, want_states=bool(cfg.feature_weight))
    hl = res[1]  # (K, n, V')
    loss, _, t1, _, _ = medusa_loss_rows(hl, targets.to(device), cfg.lam, scale=None if scale is None else scale[:K])
    nxt = None if scale is None else scale[K:]
    if cfg.feature_weight:
        loss = loss + cfg.feature_weight * feature_loss(res[2], table, rows, cfg.lam, device, nxt)
    if cfg.teacher_weight:
        loss = loss + cfg.teacher_weight * teacher_loss(hl, table, rows, run.teacher_project, cfg.lam, device, nxt)
    return loss, t1


def shares(accelerator, counts: torch.Tensor) -> torch.Tensor | None:
    """``W · counts / Σ_processes counts`` (float32; 0 where the sum is 0): the scale of each loss
    term of this process (``losses`` ``scale``). None with one process (every scale is 1)."""
    if accelerator.num_processes == 1:
        return None
    local = counts.to(torch.float64)
    total = accelerator.reduce(local.to(accelerator.device), "sum").cpu()
    return (accelerator.num_processes * local / total.clamp(min=1)).float()


@torch.no_grad()
def evaluate(trainable: Trainable, batches: list[list[int]], items: list, cfg, device, joint: bool,
             table: FeatureTable | None = None, accelerator=None) -> dict:
    """Held-out metrics over ``items`` (windows) in ``batches`` (lists of window indices), or over
    the rows of ``table``, weighted by the number of counted (position, head) pairs. With an
    ``accelerator`` of several processes, each scores every W-th batch and the sums are added up
    (every process must call this; all get the same metrics)."""
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator is not None else (0, 1)
    K = trainable.heads.num_heads
    loss_s, top1_s, top5_s, n_s = (torch.zeros(K, dtype=torch.float64) for _ in range(4))
    lm_s, lm_n = 0.0, 0
    if table is not None and not joint:
        ctx = table.windows is not None  # a context layer: whole windows, then their rows
        n_items, size = (len(table.windows), cfg.batch_size) if ctx else (len(table), cfg.rows_per_batch)
        for a in list(range(0, n_items, size))[rank::world]:
            span = range(a, min(a + size, n_items))
            rows, seq = table.window_batch(span) if ctx else (torch.arange(span.start, span.stop), None)
            h = None if seq is not None else table.hidden[rows].to(device)
            seq = None if seq is None else tuple(t.to(device) for t in seq)
            _, hl = trainable(None, None, hidden=h, tokens=table.inputs[rows].to(device), seq=seq)
            _, per, t1, t5, n = medusa_loss_rows(hl, table.targets[rows].to(device), cfg.lam, top5=True)
            n = n.double()
            loss_s += per.double() * n
            top1_s += t1.double() * n
            top5_s += t5.double() * n
            n_s += n
    else:
        for idx in batches[rank::world]:
            ids, attn, mask = (t.to(device) for t in collate([items[j] for j in idx]))
            lm, hl = trainable(ids, attn, joint=joint)
            _, per, t1, t5 = medusa_loss(hl, ids, mask, cfg.lam)
            n = head_valid_counts(mask, K).cpu().double()
            loss_s += per.double() * n
            top1_s += t1.double() * n
            top5_s += t5.double() * n
            n_s += n
            if lm is not None:
                lm_s += float(lm_loss(lm, ids, mask)) * int(mask[:, 1:].sum())
                lm_n += int(mask[:, 1:].sum())
    if world > 1:
        sums = torch.cat([loss_s, top1_s, top5_s, n_s, torch.tensor([lm_s, lm_n], dtype=torch.float64)])
        sums = accelerator.reduce(sums.to(accelerator.device), "sum").cpu()
        loss_s, top1_s, top5_s, n_s = sums[:4 * K].view(4, K)
        lm_s, lm_n = float(sums[4 * K]), int(sums[4 * K + 1])
    n_s = n_s.clamp(min=1)
    per_loss = (loss_s / n_s).tolist()
    out = {"loss": sum(cfg.lam ** k * per_loss[k] for k in range(K)), "per_head_loss": per_loss,
           "top1": (top1_s / n_s).tolist(), "top5": (top5_s / n_s).tolist(), "positions": n_s.long().tolist()}
    if lm_n:
        out["lm_loss"] = lm_s / lm_n
    return out


def lr_lambda(total: int, warmup: int, start: int = 0):
    """0 before ``start``, then a linear warm-up of ``warmup`` steps and a cosine decay to 0."""
    def f(step: int) -> float:
        s, n = step - start, max(1, total - start)
        if s < 0:
            return 0.0
        if s < warmup:
            return (s + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, n - warmup))))
    return f
