"""Train Medusa heads on self-distilled data (``data.distill``), on ``accelerate``.

Medusa-1 (``mode="medusa1"``): the backbone is frozen; its final (normed) hidden states
h (B, T, H) are computed under ``torch.no_grad`` and only the heads learn, with
``losses.medusa_loss`` (Σ_k λ^k CE_k). The heads are exactly right for the original target.

Medusa-2 (``mode="medusa2"``): LoRA adapters (``peft``, all linear layers of the backbone but the
output layer) learn together with the heads, with ``losses.combined_loss`` (CE_lm + w·Medusa-1),
``lr_heads`` > ``lr_backbone``, after a heads-only warm-up of ``warmup_heads_steps`` steps (the
adapters start at zero, so the warm-up is Medusa-1). Medusa-2 changes the backbone: as in the
Medusa paper, the intended model is the *adapted* one (``out_dir/lora_adapter`` + heads). Decode
it with ``lora=out_dir/lora_adapter`` (``--lora``): the adapter is merged into the target as it
loads (``speculant.store.lora``), and decoding is lossless with respect to the adapted model, whose
outputs may differ from the original's. The heads alone (no ``lora``) run with the original,
unadapted target: lossless with respect to it, but trained on the adapted hidden states, so their
acceptance can be lower than Medusa-1 heads'; the report's ``final_original_target`` measures
that. The caller's model is restored (``unload``) when training ends; its weights are never
modified.

Outputs (``out_dir``): the heads in the Medusa layout (``config.json``, ``model.safetensors``),
``training_report.json`` (held-out loss and per-head top-1/top-5 before and after training, and
``train_loss``: the training loss of every step, of the global batch when several processes train),
``held_out.jsonl`` (the held-out records: calibration data for ``accuracy.build_tree``),
``lora_adapter/`` (Medusa-2), and ``checkpoints/step-XXXXXXXX/`` (``heads/``, ``lora/``,
``state.pt``: optimizer, scheduler, step) to resume from (``checkpoints``).

Several processes (``accelerate launch``): each runs this function; micro-batches are shared out
and losses weighted so the run follows the one-process run with ``batch_size`` × processes
(``loop``); only the main process writes files, the others wait for it around every write.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import ConfigError
from ..heads import HeadsConfig, save_heads
from ..store.models import LoadedModel
from ..runtime.packing import unpack_linears
from .checkpoints import resume
from .loop import TrainRun, train_loop
from .setup import attach_lora, build_heads, build_run, build_tables, prepare_data, resume_fingerprint, total_steps

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
    # the heads read in training (EAGLE's robustness trick; 0: off); drawn from a generator seeded
    # by seed, micro-batch and process, so a resumed run draws what an uninterrupted one does
    feature_noise: float = 0.0
    # held-out metrics every this many steps into the report's "history" (0: only first and last)
    eval_every: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("medusa1", "medusa2"):
            raise ConfigError(f"training mode must be medusa1 or medusa2, got {self.mode!r}")
        if self.feature_noise < 0 or self.eval_every < 0 or self.weight_decay < 0:
            raise ConfigError("feature_noise, eval_every and weight_decay must be >= 0, got "
                              f"{self.feature_noise}, {self.eval_every}, {self.weight_decay}")
        for name in ("lr_heads", "lr_backbone", "lr_context"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} (the learning rate) must be > 0, got {value}")
        if self.feature_weight < 0 or self.teacher_weight < 0:
            raise ConfigError(f"feature_weight and teacher_weight must be >= 0, got {self.feature_weight}, "
                              f"{self.teacher_weight}")
        if self.train_vocab not in ("full", "data"):
            raise ConfigError(f"train_vocab must be 'full' or 'data', got {self.train_vocab!r}")
        for name in ("batch_size", "grad_accum", "seq_len", "save_every", "keep_checkpoints", "lora_r",
                     "rows_per_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 3:
            raise ConfigError("seq_len must be >= 3 (head 0 predicts two tokens ahead)")
        if not 0 <= self.held_out_fraction < 1:
            raise ConfigError(f"held_out_fraction must be in [0, 1), got {self.held_out_fraction}")
        if (self.steps is not None and self.steps < 1) or self.epochs <= 0:
            raise ConfigError("steps must be >= 1 (or None) and epochs > 0")
        if self.stop_after is not None and self.stop_after < 1:
            raise ConfigError(f"stop_after must be >= 1 (or None), got {self.stop_after}")

    @property
    def uses_feature_table(self) -> bool:
        """Training reads a table of the frozen backbone's hidden states (Medusa-1 with ``cache_features``)."""
        return self.cache_features and self.mode == "medusa1"


def train_heads(target, heads_cfg: HeadsConfig, data_path: str | os.PathLike | Sequence[str | os.PathLike],
                out_dir: str | os.PathLike, cfg: TrainConfig | None = None, *, accelerator=None,
                init_from: str | os.PathLike | None = None, **overrides) -> dict:
    """Train ``heads_cfg`` heads for ``target`` (a ``LoadedModel`` or transformers causal LM) on the
    distillation JSONL ``data_path`` (one path or several, concatenated); write heads, report and
    checkpoints to ``out_dir``. ``init_from``: a heads directory (Medusa layout, same configuration)
    whose weights the heads start from instead of a fresh initialisation (fine-tuning on new data).

    ``cfg`` fields may be given as keyword arguments (``train_heads(..., mode="medusa2", steps=100)``).
    Returns the report (also ``out_dir/training_report.json``).

    Four stages: data (``setup.prepare_data``), build (``setup.build_heads`` / ``build_tables`` /
    ``build_run``), loop (``loop.train_loop``), report (:func:`final_report`, :func:`write_outputs`).
    """
    from accelerate import Accelerator, DistributedDataParallelKwargs

    cfg = dataclasses.replace(cfg or TrainConfig(), **overrides)
    model = target.model if isinstance(target, LoadedModel) else target
    unpack_linears(model)  # nn.Linear layers for LoRA and autograd (a decoder's HFBackend packs them)
    out, t0 = Path(out_dir), time.perf_counter()
    ckpt_root = out / "checkpoints"

    # 1. data
    data = prepare_data(data_path, cfg, heads_cfg)
    if accelerator is None:
        kw = [DistributedDataParallelKwargs(find_unused_parameters=True)] if cfg.mode == "medusa2" else []
        accelerator = Accelerator(kwargs_handlers=kw)
    world, rank = accelerator.num_processes, accelerator.process_index
    warn_one_cpu_process(world)

    # 2. build
    heads = build_heads(model, heads_cfg, cfg, data, init_from)
    tables = build_tables(model, heads, cfg, data, accelerator) if cfg.uses_feature_table else None
    total, batches = total_steps(cfg, data, tables, bool(heads_cfg.context_size), world, rank)
    fingerprint = resume_fingerprint(cfg, heads_cfg, data, total, world, init_from)
    if accelerator.is_main_process:
        if not cfg.resume:
            shutil.rmtree(ckpt_root, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)  # the held-out records: calibration data for build_tree
        (out / "held_out.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                    for r in data.held_records), encoding="utf-8")
    accelerator.wait_for_everyone()  # the checkpoints are read (resume) after the main process's clean-up
    peft_model = attach_lora(model, cfg)
    try:
        run = build_run(model, heads, peft_model, cfg, data, tables, batches, total, fingerprint, ckpt_root,
                        accelerator)
        resume(run)
        # 3. loop
        train_loop(run)
        # 4. report
        report = final_report(run, heads_cfg, time.perf_counter() - t0)
        if accelerator.is_main_process:
            write_outputs(run, out, report)
        accelerator.wait_for_everyone()
        return report
    finally:
        if peft_model is not None:
            peft_model.unload()  # the caller's model gets its original modules back (weights untouched)


def final_report(run: TrainRun, heads_cfg: HeadsConfig, seconds: float) -> dict:
    """The run's report: its steps and data, the held-out metrics before and after training (and
    their history), and, for Medusa-2, the heads' metrics with the original (unadapted) target."""
    cfg, data = run.cfg, run.data
    report = {"mode": cfg.mode, "step": run.step, "total_steps": run.total, "finished": run.step >= run.total,
              "resumed_from": run.resumed_from,
              "train_rows": len(run.train_table) if run.train_table is not None else None,
              "train_vocab_size": len(data.vocab) if data.vocab is not None else heads_cfg.vocab_size,
              "train_windows": len(data.train), "held_out_windows": len(data.held),
              "processes": run.accelerator.num_processes, "seconds_this_run": round(seconds, 1),
              "initial": run.initial, "train_loss": run.train_loss, "config": dataclasses.asdict(cfg),
              "heads": heads_cfg.to_json()}
    if run.held_batches:
        report["final"] = run.evaluate()
        report["history"] = run.history + [{"step": run.step, **report["final"]}]
        if run.peft_model is not None:
            with run.peft_model.disable_adapter():  # what the heads do for the ORIGINAL target
                report["final_original_target"] = run.evaluate(joint=False, table=False)
    return report


def write_outputs(run: TrainRun, out: Path, report: dict) -> None:
    """The heads (and Medusa-2's adapter) and ``training_report.json`` in ``out``."""
    save_heads(run.core.heads, out)
    if run.peft_model is not None:
        run.peft_model.save_pretrained(str(out / "lora_adapter"))
        report["note"] = ("medusa2: lora_adapter + heads is the Medusa-2 model: decode it with --lora OUT/lora_adapter "
                          "--heads OUT (lossless w.r.t. the adapted backbone); the heads alone, used with the original "
                          "target, decode it losslessly but were trained on adapted hidden states: see "
                          "final_original_target")
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")


def warn_one_cpu_process(world: int) -> None:
    """``accelerate launch --cpu --num_processes N`` (N > 1) starts ONE process unless it is given
    an MPI host file (accelerate 1.15): say so, and how to start N, instead of training on one."""
    launched_many = os.environ.get("MASTER_ADDR") and "LOCAL_RANK" not in os.environ and "PMI_SIZE" not in os.environ
    if world == 1 and os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true") and launched_many:
        print("speculant: note: training on one process: accelerate launch --cpu starts one process. For N "
              "processes on CPUs run ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N ...",
              file=sys.stderr, flush=True)
