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

import torch
from torch import nn

from ..errors import ConfigError
from ..models import LoadedModel
from ..heads import HeadsConfig, MedusaHeads, save_heads
from .data import Batches, collate, load_records, windows
from .losses import combined_loss, head_valid_counts, lm_loss, medusa_loss

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
    cache_features: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("medusa1", "medusa2"):
            raise ConfigError(f"training mode must be medusa1 or medusa2, got {self.mode!r}")
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

    def __init__(self, model: nn.Module, heads: MedusaHeads):
        super().__init__()
        self.model, self.heads = model, heads

    def forward(self, ids: torch.Tensor, attn: torch.Tensor, joint: bool = False, hidden: torch.Tensor | None = None):
        if hidden is None:
            hidden = self.backbone(ids, attn, joint)
        lm = self.model.get_output_embeddings()(hidden) if joint else None
        return lm, self.heads(hidden)

    def backbone(self, ids: torch.Tensor, attn: torch.Tensor, joint: bool = False) -> torch.Tensor:
        with torch.set_grad_enabled(joint and torch.is_grad_enabled()):
            return self.model.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state  # (B, T, H)


class _FeatureStore:
    """Medusa-1 trains against a frozen backbone, so each window's final hidden states never change:
    compute them once (the first time the window is drawn) and reuse them every later epoch.

    Positions that no head can learn from (prompt positions more than K+1 tokens before the first
    target) are dropped: heads act position by position and the loss pairs position t with token
    t+k+2 of the same (shifted) window, so the cut changes no counted pair. Kept per window:
    hidden (T', H) in the backbone's dtype, ids (T',), mask (T',)."""

    def __init__(self, items: list[tuple[list[int], list[bool]]], num_heads: int):
        self.items, self.K = items, num_heads
        self.store: dict[int, tuple[torch.Tensor, list[int], list[bool]]] = {}

    def batch(self, idx: list[int], trainable: _Trainable, device) -> tuple[torch.Tensor, ...]:
        """-> hidden (B, T, H), ids (B, T), attn (B, T), mask (B, T): right-padded like ``collate``."""
        missing = [j for j in idx if j not in self.store]
        if missing:
            ids, attn, _ = collate([self.items[j] for j in missing])
            with torch.no_grad():
                hidden = trainable.backbone(ids.to(device), attn.to(device)).detach().cpu()
            for r, j in enumerate(missing):
                w, m = self.items[j]
                first = next(t for t, v in enumerate(m) if v and t >= 2)
                s0 = max(0, first - 2 - (self.K - 1))
                self.store[j] = (hidden[r, s0:len(w)].clone(), w[s0:], m[s0:])
        parts = [self.store[j] for j in idx]
        ids, attn, mask = collate([(w, m) for _, w, m in parts])
        hidden = parts[0][0].new_zeros(ids.shape[0], ids.shape[1], parts[0][0].shape[-1])
        for r, (h, _, _) in enumerate(parts):
            hidden[r, :h.shape[0]] = h
        return hidden.to(device), ids.to(device), attn.to(device), mask.to(device)


@torch.no_grad()
def _evaluate(trainable: _Trainable, batches: list[list[int]], items: list, cfg: TrainConfig,
              device, joint: bool, store: _FeatureStore | None = None) -> dict:
    """Held-out metrics over ``items`` (windows) in ``batches`` (lists of window indices),
    weighted by the number of counted (position, head) pairs."""
    K = trainable.heads.num_heads
    loss_s, top1_s, top5_s, n_s = (torch.zeros(K, dtype=torch.float64) for _ in range(4))
    lm_s, lm_n = 0.0, 0
    for idx in batches:
        if store is not None and not joint:
            hidden, ids, attn, mask = store.batch(idx, trainable, device)
            lm, hl = trainable(ids, attn, hidden=hidden)
        else:
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


def _save(ckpt_root: Path, step: int, heads: MedusaHeads, peft_model, state: dict, keep: int) -> None:
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


def train_heads(target, heads_cfg: HeadsConfig, data_path: str | os.PathLike, out_dir: str | os.PathLike,
                cfg: TrainConfig | None = None, *, accelerator=None, **overrides) -> dict:
    """Train ``heads_cfg`` heads for ``target`` (a ``LoadedModel`` or transformers causal LM) on the
    distillation JSONL ``data_path``; write heads, report and checkpoints to ``out_dir``.

    ``cfg`` fields may be given as keyword arguments (``train_heads(..., mode="medusa2", steps=100)``).
    Returns the report (also ``out_dir/training_report.json``).
    """
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from safetensors.torch import load_file
    from tqdm.auto import tqdm

    cfg = dataclasses.replace(cfg or TrainConfig(), **overrides)
    model = target.model if isinstance(target, LoadedModel) else target
    out, t0 = Path(out_dir), time.perf_counter()
    ckpt_root = out / "checkpoints"
    records = load_records(data_path)
    if len(records) < 1:
        raise ConfigError(f"no training records in {data_path}: make them first (speculant.training.data.distill)")
    perm = torch.randperm(len(records), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    n_held = min(len(records) - 1, math.ceil(cfg.held_out_fraction * len(records))) if cfg.held_out_fraction else 0
    held = windows([records[i] for i in perm[:n_held]], cfg.seq_len, cfg.train_on_prompt)
    train = windows([records[i] for i in perm[n_held:]], cfg.seq_len, cfg.train_on_prompt)
    if not train:
        raise ConfigError(f"{data_path} yields no training window (answers of >= 3 tokens needed)")
    if accelerator is None:
        kw = [DistributedDataParallelKwargs(find_unused_parameters=True)] if cfg.mode == "medusa2" else []
        accelerator = Accelerator(kwargs_handlers=kw)
    world, rank = accelerator.num_processes, accelerator.process_index
    batches = Batches(train, cfg.batch_size, cfg.seed, rank, world)
    total = cfg.steps or max(1, math.ceil(cfg.epochs * batches.per_epoch / (world * cfg.grad_accum)))
    fingerprint = {"mode": cfg.mode, "heads": heads_cfg.to_json(), "seed": cfg.seed, "steps": total,
                   "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum, "seq_len": cfg.seq_len,
                   "world": world, "data_sha256": hashlib.sha256(Path(data_path).read_bytes()).hexdigest()}
    if accelerator.is_main_process:
        if not cfg.resume:
            shutil.rmtree(ckpt_root, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)  # the held-out records: calibration data for build_tree
        (out / "held_out.jsonl").write_text("".join(json.dumps(records[i], ensure_ascii=False) + "\n"
                                                    for i in perm[:n_held]), encoding="utf-8")

    torch.manual_seed(cfg.seed)
    heads = MedusaHeads(heads_cfg, model.get_output_embeddings()).float()
    peft_model = None
    if cfg.mode == "medusa2":
        from peft import LoraConfig, get_peft_model
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules="all-linear")
        peft_model = get_peft_model(model, lora)  # injects LoRA layers into `model` in place
    try:
        trainable = _Trainable(model, heads)
        groups = [{"params": list(heads.parameters()), "lr": cfg.lr_heads}]
        lambdas = [_lr_lambda(total, cfg.lr_warmup_steps)]
        if peft_model is not None:
            groups.append({"params": [p for p in model.parameters() if p.requires_grad], "lr": cfg.lr_backbone})
            lambdas.append(_lr_lambda(total, cfg.lr_warmup_steps, cfg.warmup_heads_steps))
        optimizer = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
        trainable, optimizer = accelerator.prepare(trainable, optimizer)
        core = accelerator.unwrap_model(trainable)
        device = accelerator.device
        held_batches = [list(range(i, min(i + cfg.batch_size, len(held)))) for i in range(0, len(held), cfg.batch_size)]
        use_store = cfg.cache_features and peft_model is None
        train_store = _FeatureStore(train, heads_cfg.num_heads) if use_store else None
        held_store = _FeatureStore(held, heads_cfg.num_heads) if use_store else None

        step, initial, resumed_from = 0, None, None
        latest = _latest(ckpt_root) if cfg.resume else None
        if latest is not None:
            state = torch.load(latest / "state.pt", weights_only=True)
            if state["fingerprint"] != fingerprint:
                diff = sorted(k for k in fingerprint if state["fingerprint"].get(k) != fingerprint[k])
                raise ConfigError(f"cannot resume from {latest}: it was made with other settings ({', '.join(diff)}); "
                                  "use another output directory, or resume=False (--no-resume) to start over")
            core.heads.heads.load_state_dict(load_file(str(latest / "heads" / "model.safetensors")))
            if peft_model is not None:
                from peft import set_peft_model_state_dict
                set_peft_model_state_dict(peft_model, load_file(str(latest / "lora" / "adapter_model.safetensors")))
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            step, initial = int(state["step"]), state["initial"]
            resumed_from = step
        if initial is None:
            initial = _evaluate(core, held_batches, held, cfg, device, False, held_store) if held_batches else {}

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
                    if train_store is not None:
                        hidden, ids, attn, mask = train_store.batch(batches.indices(m), core, device)
                        lm, hl = trainable(ids, attn, hidden=hidden)
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
            if step % cfg.save_every == 0 or step == stop:
                if accelerator.is_main_process:
                    state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                             "fingerprint": fingerprint, "initial": initial}
                    _save(ckpt_root, step, core.heads, peft_model, state, cfg.keep_checkpoints)
                accelerator.wait_for_everyone()
        bar.close()

        report = {"mode": cfg.mode, "step": step, "total_steps": total, "finished": step >= total,
                  "resumed_from": resumed_from,
                  "train_windows": len(train), "held_out_windows": len(held), "processes": world,
                  "seconds_this_run": round(time.perf_counter() - t0, 1), "initial": initial,
                  "config": dataclasses.asdict(cfg), "heads": heads_cfg.to_json()}
        if held_batches:
            report["final"] = _evaluate(core, held_batches, held, cfg, device, peft_model is not None, held_store)
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
