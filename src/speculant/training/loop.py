"""The third stage of head training (``train.train_heads``): the optimizer steps, held-out
evaluation, and the checkpoints a run resumes from.

A micro-batch is either rows of the frozen backbone's feature table (Medusa-1 with
``cache_features``; whole windows for heads with a context layer) or windows of tokens the backbone
runs on (Medusa-2, or Medusa-1 without the table). Shapes: B windows of T tokens, n rows, K heads,
V (or V') tokens scored, H = hidden size.

Checkpoints: ``checkpoints/step-XXXXXXXX/`` (``heads/``, ``lora/``, ``state.pt``: optimizer,
scheduler, step, the settings' fingerprint, the held-out history); a checkpoint directory appears
whole (written under a temporary name, then renamed into place).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import ConfigError
from ..heads import MedusaHeads, SequentialHeads, save_heads
from .data import collate
from .features import FeatureTable, Trainable, feature_loss, teacher_loss
from .losses import combined_loss, head_valid_counts, lm_loss, medusa_loss, medusa_loss_rows

__all__ = ["TrainRun", "evaluate", "lr_lambda", "resume", "train_loop"]


@dataclass
class TrainRun:
    """Everything the loop reads and updates. ``trainable``: the model and heads as prepared by
    ``accelerator`` (maybe wrapped), ``core`` the unwrapped :class:`Trainable`; ``train_table`` /
    ``held_table``: the feature tables, or None (then ``batches`` holds the training windows);
    ``data``: a ``setup.TrainData``; ``held_batches``: lists of held-out window indices.
    ``step``, ``initial`` (held-out metrics before training), ``resumed_from`` and ``history``
    (metrics every ``cfg.eval_every`` steps) change as the run goes."""

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

    @property
    def stop(self) -> int:
        """The step this run ends at (``cfg.stop_after`` ends it early, to be resumed)."""
        return min(self.total, self.cfg.stop_after) if self.cfg.stop_after else self.total

    def evaluate(self, joint: bool | None = None, table: bool = True) -> dict:
        """Held-out metrics of the heads now (``joint``: with the adapters' LM loss; default: iff
        there are adapters)."""
        joint = self.peft_model is not None if joint is None else joint
        return evaluate(self.core, self.held_batches, self.data.held, self.cfg, self.accelerator.device, joint,
                        self.held_table if table else None)


def train_loop(run: TrainRun) -> None:
    """Optimizer steps from ``run.step`` to ``run.stop``: ``cfg.grad_accum`` micro-batches each,
    held-out metrics every ``cfg.eval_every`` steps, a checkpoint every ``cfg.save_every`` and at the end."""
    from tqdm.auto import tqdm

    cfg, accelerator = run.cfg, run.accelerator
    params = [p for g in run.optimizer.param_groups for p in g["params"]]
    bar = tqdm(total=run.total, initial=run.step, desc=f"train-heads ({cfg.mode})", unit="step",
               disable=not (cfg.progress and accelerator.is_local_main_process))
    stop = run.stop
    while run.step < stop:
        joint = run.peft_model is not None and run.step >= cfg.warmup_heads_steps
        run.optimizer.zero_grad(set_to_none=True)
        for a in range(cfg.grad_accum):
            last = a == cfg.grad_accum - 1
            with contextlib.nullcontext() if last else accelerator.no_sync(run.trainable):
                loss, t1 = micro_batch_loss(run, run.step * cfg.grad_accum + a, joint)
                accelerator.backward(loss / cfg.grad_accum)
        if cfg.max_grad_norm:
            accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
        run.optimizer.step()
        run.scheduler.step()
        run.step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", top1=f"{float(t1[0]):.2f}", refresh=False)
        if cfg.eval_every and run.held_batches and run.step % cfg.eval_every == 0 and run.step < stop:
            ev = run.evaluate()
            run.history.append({"step": run.step, **ev})
            bar.write(f"step {run.step}: held-out loss {ev['loss']:.3f}, top-1 "
                      + " ".join(f"{x:.3f}" for x in ev["top1"]))
        if run.step % cfg.save_every == 0 or run.step == stop:
            if accelerator.is_main_process:
                state = {"step": run.step, "optimizer": run.optimizer.state_dict(),
                         "scheduler": run.scheduler.state_dict(), "fingerprint": run.fingerprint,
                         "initial": run.initial, "history": run.history}
                save_checkpoint(run.ckpt_root, run.step, run.core.heads, run.peft_model, state, cfg.keep_checkpoints)
            accelerator.wait_for_everyone()
    bar.close()


def micro_batch_loss(run: TrainRun, m: int, joint: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The training loss of micro-batch ``m`` of this process and its per-head top-1 (K,)."""
    cfg, table, device = run.cfg, run.train_table, run.accelerator.device
    rank, world = run.accelerator.process_index, run.accelerator.num_processes
    if table is None:  # windows of tokens through the backbone
        ids, attn, mask = (t.to(device) for t in run.batches[m])
        lm, hl = run.trainable(ids, attn, joint=joint)
        if joint:
            loss, _, _, _, t1, _ = combined_loss(lm, hl, ids, mask, cfg.lam, cfg.heads_weight)
        else:
            loss, _, t1, _ = medusa_loss(hl, ids, mask, cfg.lam)
        return loss, t1
    hidden = seq = None
    if table.windows is not None:  # a context layer: whole windows
        rows, seq = table.window_batch(table.window_order(m, cfg.batch_size, cfg.seed, rank, world), cfg.feature_noise)
        seq = tuple(t.to(device) for t in seq)
    else:
        rows = table.rows(m, cfg.rows_per_batch, cfg.seed, rank, world)
        hidden = table.hidden[rows].to(device)  # (n, H)
    if cfg.feature_noise and hidden is not None:
        rms = hidden.float().pow(2).mean(-1, keepdim=True).sqrt()
        noise = (torch.rand(hidden.shape, device=device) * 2 - 1) * (cfg.feature_noise * rms)
        hidden = (hidden.float() + noise).to(hidden.dtype)
    vocab, remap = run.data.vocab, run.data.remap
    res = run.trainable(None, None, hidden=hidden, seq=seq, tokens=table.inputs[rows].to(device),
                        vocab=vocab.to(device) if vocab is not None else None, want_states=bool(cfg.feature_weight))
    hl = res[1]  # (K, n, V')
    targets = table.targets[rows] if remap is None else remap[table.targets[rows]]
    loss, _, t1, _, _ = medusa_loss_rows(hl, targets.to(device), cfg.lam)
    if cfg.feature_weight:
        loss = loss + cfg.feature_weight * feature_loss(res[2], table, rows, cfg.lam, device)
    if cfg.teacher_weight:
        loss = loss + cfg.teacher_weight * teacher_loss(hl, table, rows, run.teacher_project, cfg.lam, device)
    return loss, t1


@torch.no_grad()
def evaluate(trainable: Trainable, batches: list[list[int]], items: list, cfg, device, joint: bool,
             table: FeatureTable | None = None) -> dict:
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


# ----------------------------------------------------------------------------------- checkpoints

def resume(run: TrainRun) -> None:
    """Continue from the latest whole checkpoint (made with the same settings) if ``cfg.resume``;
    then the held-out metrics before training, unless the checkpoint holds them."""
    from safetensors.torch import load_file

    latest = latest_checkpoint(run.ckpt_root) if run.cfg.resume else None
    if latest is not None:
        state = torch.load(latest / "state.pt", weights_only=True)
        if state["fingerprint"] != run.fingerprint:
            diff = sorted(k for k in run.fingerprint if state["fingerprint"].get(k) != run.fingerprint[k])
            raise ConfigError(f"cannot resume from {latest}: it was made with other settings ({', '.join(diff)}); "
                              "use another output directory, or resume=False (--no-resume) to start over")
        run.core.heads.load_weights(load_file(str(latest / "heads" / "model.safetensors")))
        if run.peft_model is not None:
            from peft import set_peft_model_state_dict
            set_peft_model_state_dict(run.peft_model, load_file(str(latest / "lora" / "adapter_model.safetensors")))
        run.optimizer.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["scheduler"])
        run.step, run.initial = int(state["step"]), state["initial"]
        run.resumed_from = run.step
        run.history = list(state.get("history", []))
    if run.initial is None:
        run.initial = run.evaluate(joint=False) if run.held_batches else {}


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    done = sorted(p for p in ckpt_root.glob("step-*") if (p / "state.pt").is_file())
    return done[-1] if done else None


def save_checkpoint(ckpt_root: Path, step: int, heads: MedusaHeads | SequentialHeads, peft_model, state: dict,
                    keep: int) -> None:
    """Write ``step-XXXXXXXX`` whole (a temporary directory renamed into place); keep the last ``keep``."""
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
