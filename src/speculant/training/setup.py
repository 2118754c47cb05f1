"""The first two stages of head training (``train.train_heads``).

data    the distillation records, split into training and held-out windows; the options checked
        against the heads and the data; the training vocabulary (``train_vocab="data"``)
build   the heads (fresh, or from ``init_from``), the frozen backbone's feature tables, the
        optimizer and learning-rate schedule, and the state of a run to resume

Shapes: V = vocabulary size, V' = tokens trained over, H = hidden size, K = number of heads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..heads import HeadsConfig, MedusaHeads, SequentialHeads, load_heads, make_heads
from ..runtime.weights import weights_of
from .data import Batches, load_records, windows
from .features import FeatureTable, Trainable, feature_tables
from .loop import TrainRun, lr_lambda
from .vocab import draft_vocabulary

__all__ = ["TrainData", "attach_lora", "build_heads", "build_run", "build_tables", "check_options", "draft_vocabulary",
           "prepare_data", "resume_fingerprint", "teacher_projection", "total_steps"]


# ------------------------------------------------------------------------------------------ data

@dataclass
class TrainData:
    """The records of a run and their split. ``perm``: a seeded permutation of the records, whose
    first ``n_held`` are held out; ``train`` / ``held``: their windows (``data.windows``);
    ``sha256``: one digest per data file (the resume fingerprint and the feature cache key).
    With ``train_vocab="data"``: ``vocab`` (V',) long, the tokens the records hold, and ``remap``
    (V + 1,) long, a token id -> its index in ``vocab`` (-1 -> -1, no target); else None."""

    paths: list[Path]
    records: list[dict]
    sha256: list[str]
    perm: list[int]
    n_held: int
    train: list
    held: list
    vocab: torch.Tensor | None = None
    remap: torch.Tensor | None = None

    @property
    def held_records(self) -> list[dict]:
        return [self.records[i] for i in self.perm[:self.n_held]]

    @property
    def train_records(self) -> list[dict]:
        return [self.records[i] for i in self.perm[self.n_held:]]


def prepare_data(data_path: str | os.PathLike | Sequence[str | os.PathLike], cfg, heads_cfg: HeadsConfig) -> TrainData:
    """Read the JSONL ``data_path`` (one path or several, concatenated), split it and check the
    options of ``cfg`` (a ``TrainConfig``) against ``heads_cfg`` and the records."""
    paths = [Path(data_path)] if isinstance(data_path, (str, os.PathLike)) else [Path(p) for p in data_path]
    records = [r for p in paths for r in load_records(p)]
    sha256 = [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]
    if len(records) < 1:
        raise ConfigError(f"no training records in {', '.join(map(str, paths))}: make them first "
                          "(speculant.training.data.distill)")
    perm = torch.randperm(len(records), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    n_held = min(len(records) - 1, math.ceil(cfg.held_out_fraction * len(records))) if cfg.held_out_fraction else 0
    held = windows([records[i] for i in perm[:n_held]], cfg.seq_len, cfg.train_on_prompt)
    train = windows([records[i] for i in perm[n_held:]], cfg.seq_len, cfg.train_on_prompt)
    if not train:
        raise ConfigError(f"{', '.join(map(str, paths))} yields no training window (answers of >= 3 tokens needed)")
    check_options(cfg, heads_cfg)
    data = TrainData(paths, records, sha256, perm, n_held, train, held)
    if cfg.train_vocab == "data":
        if not (cfg.uses_feature_table and heads_cfg.shared_lm_head):
            raise ConfigError("train_vocab='data' needs the feature table (mode medusa1, cache_features) and heads "
                              "that project through the shared output layer")
        vocab = torch.tensor(sorted({t for r in records for t in r["ids"]}), dtype=torch.long)
        if int(vocab[-1]) >= heads_cfg.vocab_size:
            raise ConfigError(f"the records hold token {int(vocab[-1])}, "
                              f"outside the {heads_cfg.vocab_size}-token vocabulary")
        remap = torch.full((heads_cfg.vocab_size + 1,), -1, dtype=torch.long)  # remap[-1] == -1: no target
        remap[vocab] = torch.arange(len(vocab))
        data.vocab, data.remap = vocab, remap
    return data


def check_options(cfg, heads_cfg: HeadsConfig) -> None:
    """The options that need the feature table (a frozen backbone) or a kind of heads."""
    flat = cfg.uses_feature_table
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


# ----------------------------------------------------------------------------------------- build

def build_heads(model: nn.Module, heads_cfg: HeadsConfig, cfg, data: TrainData,
                init_from: str | os.PathLike | None) -> MedusaHeads | SequentialHeads:
    """Fresh float32 heads of ``heads_cfg`` (seeded with ``cfg.seed``), or the weights of the heads
    directory ``init_from`` (same configuration; heads without a context layer may start heads
    with one, whose layer then starts as the identity); a draft vocabulary from the training answers."""
    torch.manual_seed(cfg.seed)
    heads = make_heads(heads_cfg, model).float()
    if init_from is not None:
        start = load_heads(init_from, model, dtype=torch.float32)
        shape = dataclasses.replace(start.config, base_model=heads_cfg.base_model)
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
        heads.set_draft_vocab(draft_vocabulary(data.train_records, heads_cfg.draft_vocab, heads_cfg.vocab_size))
    return heads


def teacher_projection(model: nn.Module, vocab: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The target's frozen output layer as the teacher loss reads it: hidden states (m, H) -> logits
    (m, V'), cut to the trained vocabulary once (not every step)."""
    out_layer = weights_of(model.get_output_embeddings())
    weight = out_layer.dense_weight()
    bias = out_layer.bias.detach() if out_layer.bias is not None else None
    if vocab is not None:
        weight, bias = weight[vocab], (bias[vocab] if bias is not None else None)

    def project(h: torch.Tensor) -> torch.Tensor:
        return F.linear(h.to(weight.dtype), weight, bias)
    return project


def build_tables(model: nn.Module, heads: MedusaHeads | SequentialHeads, cfg, data: TrainData,
                 accelerator) -> tuple[FeatureTable, FeatureTable]:
    """The frozen backbone runs once, here (or its tables are read from ``cfg.feature_cache``, kept
    by an earlier run on the same records, split, windows, K and backbone); training reads them."""
    hc = heads.config
    key = [data.sha256, cfg.seed, cfg.held_out_fraction, cfg.seq_len, cfg.train_on_prompt,
           hc.num_heads, hc.base_model, hc.hidden_size, str(next(model.parameters()).dtype)]
    return feature_tables(data.train, data.held, hc.num_heads, Trainable(model, heads).to(accelerator.device),
                          accelerator.device, key=key, cache_dir=cfg.feature_cache, keep_windows=bool(hc.context_size),
                          progress=cfg.progress and accelerator.is_local_main_process,
                          main_process=accelerator.is_main_process)


def total_steps(cfg, data: TrainData, tables: tuple[FeatureTable, FeatureTable] | None, context: bool,
                world: int, rank: int) -> tuple[int, Batches | None]:
    """The run's optimizer steps (``cfg.steps``, or ``cfg.epochs`` passes over the training data)
    and, without a feature table, the window batches of this process."""
    batches = None
    if tables is not None:
        per_epoch = math.ceil((len(tables[0].windows) / cfg.batch_size) if context
                              else len(tables[0]) / cfg.rows_per_batch)
    else:
        batches = Batches(data.train, cfg.batch_size, cfg.seed, rank, world)
        per_epoch = batches.per_epoch
    return cfg.steps or max(1, math.ceil(cfg.epochs * per_epoch / (world * cfg.grad_accum))), batches


def resume_fingerprint(cfg, heads_cfg: HeadsConfig, data: TrainData, total: int, world: int,
                init_from: str | os.PathLike | None) -> dict:
    """The settings a checkpoint must have been made with to be resumed."""
    flat = cfg.uses_feature_table
    return {"mode": cfg.mode, "heads": heads_cfg.to_json(), "seed": cfg.seed, "steps": total,
            "batch_size": cfg.rows_per_batch if flat and not heads_cfg.context_size else cfg.batch_size,
            "flat": flat, "lr_context": cfg.lr_context,
            "train_vocab": cfg.train_vocab, "feature_weight": cfg.feature_weight, "feature_noise": cfg.feature_noise,
            "teacher_weight": cfg.teacher_weight,
            "weight_decay": cfg.weight_decay,
            "grad_accum": cfg.grad_accum, "seq_len": cfg.seq_len,
            "world": world, "data_sha256": data.sha256,
            "init_from": str(init_from) if init_from is not None else None}


def attach_lora(model: nn.Module, cfg):
    """Medusa-2: LoRA adapters injected into ``model`` in place (all linear layers but the output
    layer); the peft model, or None for Medusa-1."""
    if cfg.mode != "medusa2":
        return None
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules="all-linear")
    return get_peft_model(model, lora)


def build_run(model: nn.Module, heads: MedusaHeads | SequentialHeads, peft_model, cfg, data: TrainData,
              tables: tuple[FeatureTable, FeatureTable] | None, batches: Batches | None, total: int,
              fingerprint: dict, ckpt_root: Path, accelerator) -> TrainRun:
    """The optimizer (AdamW; the heads, a context layer and the adapters each with their own
    learning rate), its schedule (a linear warm-up and a cosine decay; the adapters start after
    ``cfg.warmup_heads_steps``), both prepared by ``accelerator``."""
    trainable = Trainable(model, heads)
    context = heads.context if isinstance(heads, SequentialHeads) else None  # its own learning rate
    in_context = {id(p) for p in context.parameters()} if context is not None else set()
    groups = [{"params": [p for p in heads.parameters() if id(p) not in in_context], "lr": cfg.lr_heads}]
    lambdas = [lr_lambda(total, cfg.lr_warmup_steps)]
    if context is not None:
        groups.append({"params": list(context.parameters()), "lr": cfg.lr_context or cfg.lr_heads})
        lambdas.append(lr_lambda(total, cfg.lr_warmup_steps))
    if peft_model is not None:
        groups.append({"params": [p for p in model.parameters() if p.requires_grad], "lr": cfg.lr_backbone})
        lambdas.append(lr_lambda(total, cfg.lr_warmup_steps, cfg.warmup_heads_steps))
    optimizer = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
    trainable, optimizer = accelerator.prepare(trainable, optimizer)
    held = data.held
    return TrainRun(cfg=cfg, accelerator=accelerator, trainable=trainable, core=accelerator.unwrap_model(trainable),
                    optimizer=optimizer, scheduler=scheduler, peft_model=peft_model, data=data,
                    train_table=tables[0] if tables else None, held_table=tables[1] if tables else None,
                    batches=batches,
                    teacher_project=teacher_projection(model, data.vocab) if cfg.teacher_weight else None,
                    total=total, fingerprint=fingerprint, ckpt_root=ckpt_root,
                    held_batches=[list(range(i, min(i + cfg.batch_size, len(held))))
                                  for i in range(0, len(held), cfg.batch_size)])
