"""Training the EAGLE drafter on a corpus of the target's own answers (``make-corpus``).

1. Features, once: the target's final hidden states at every position of every record
   (:func:`compute_features`; any Backend with ``HiddenNeed.ALL``), kept as bf16 in safetensors
   shards of a few hundred records, so a long computation resumes where it stopped.
2. The drafter learns, at every pair (h_i, x_{i+1}) of a window of a record, to predict the
   target's next feature h_{i+1} (smooth L1, EAGLE's regression) and the token after it x_{i+2}
   (cross-entropy through the target's frozen output layer, over the draft vocabulary when there is
   one): ``feature_weight`` * L1 + ``token_weight`` * CE, on the pairs whose x_{i+2} is an answer
   token. The pairs before them (the prompt) are context.
3. Held out: per-depth accuracy, the share of answer positions where the drafter's greedy chain
   of its own features guesses the next d tokens all right (what a chain of depth d would accept).

Runs under ``accelerate`` (one process, or several: each takes its share of every batch);
checkpoints every ``checkpoint_every`` steps (accelerate's state: drafter, optimizer, scheduler, and
the step), and a run started again over the same output directory resumes from the latest.
Shapes: B windows of T pairs, H hidden size, V' drafted tokens.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .eagle_features import compute_features, features_cost, load_features
from ..eagle.model import EagleCache, EagleModel
from ..runtime.weights import weights_of

__all__ = ["EagleTrainConfig", "answer_positions", "compute_features", "depth_accuracy", "features_cost",
           "load_features", "split_records", "train_eagle", "training_precision", "window_sample"]

_TRIM_EVERY = 20  # steps between handing the C heap's free pages back (train_eagle)


@dataclass(frozen=True)
class EagleTrainConfig:
    steps: int = 1000
    batch_size: int = 8  # windows per optimizer step (over all processes)
    seq_len: int = 512  # pairs per window
    lr: float = 3e-4
    warmup: int = 50
    feature_weight: float = 1.0
    token_weight: float = 0.1
    held_out: int = 16  # records kept for the held-out accuracy
    eval_depth: int = 5
    checkpoint_every: int = 100
    seed: int = 0
    # "bfloat16": the forward and backward passes under CPU autocast (AMX / AVX512-BF16 CPUs run
    # them 2-3x faster); the weights and the optimizer stay float32. "auto": bfloat16 on those
    # CPUs, float32 elsewhere (where bf16 arithmetic is emulated), resolved when the config is made
    precision: str = "auto"
    # uniform noise U(-a, a) x each row's RMS added to the input features (EAGLE's augmentation: at
    # drafting time the drafter reads its own, imperfect features after the first step)
    feature_noise: float = 0.0
    # training-time test (EAGLE-3): each window also unrolled for draft steps 2 .. draft_steps on
    # the drafter's own features, step s's loss weighted step_decay^(s-1)
    draft_steps: int = 1
    step_decay: float = 0.8
    max_grad_norm: float = 0.5  # gradient clipping (0: none); the features' outliers make spikes otherwise
    # the token loss's target: "data", the record's next token (the target's own greedy answers);
    # "target", the target's own distribution there, softmax(lm_head(h_{i+1})) over the drafted
    # vocabulary (soft cross-entropy: EAGLE's and HASS's distillation), for text the target did not
    # write (teacher-forced conversations), where the record's next token is not the target's
    token_target: str = "data"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_depth", "checkpoint_every", "draft_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"EAGLE training {name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not (self.lr > 0 and self.feature_weight >= 0 and self.token_weight >= 0 and self.held_out >= 0
                and self.feature_noise >= 0 and 0 < self.step_decay <= 1 and self.max_grad_norm >= 0):
            raise ConfigError("EAGLE training needs lr > 0 and non-negative weights and held_out")
        if self.precision not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"EAGLE training precision must be 'auto', 'float32' or 'bfloat16', "
                              f"got {self.precision!r}")
        if self.token_target not in ("data", "target"):
            raise ConfigError(f"EAGLE training token_target must be 'data' or 'target', got {self.token_target!r}")
        if self.precision == "auto":
            object.__setattr__(self, "precision", training_precision())


def training_precision() -> str:
    """"bfloat16" where the CPU multiplies bf16 natively (AVX512-BF16, which every AMX CPU also
    has), else "float32"."""
    from ..kernels import cpu_has_avx512_bf16

    return "bfloat16" if cpu_has_avx512_bf16() else "float32"


def answer_mask(record: dict) -> torch.Tensor:
    """(L + 1,) bool: which of the record's L tokens are answer tokens (its ``spans``, or every
    token from ``prompt_len`` on: :func:`..training.conversations.answer_spans`); the extra last
    entry repeats the last token's, so ``mask[j + 1]`` says whether h_j predicts an answer token
    for every position j."""
    from .conversations import answer_spans

    L = len(record["ids"])
    mask = torch.zeros(L + 1, dtype=torch.bool)
    for a, b in answer_spans(record):
        mask[max(a, 0):min(b, L)] = True
    mask[L] = mask[L - 1] if L else False
    return mask


def _windows(records: Sequence[dict], seq_len: int) -> list[tuple[int, int, int]]:
    """(record, first pair, pairs) windows of at most ``seq_len`` pairs that hold answer targets."""
    out = []
    for r, rec in enumerate(records):
        pairs = len(rec["ids"]) - 1  # pair i = (h_i, x_{i+1}), i < L - 1
        mask = answer_mask(rec)
        for a in range(0, pairs, seq_len):
            n = min(seq_len, pairs - a)
            if bool(mask[a + 2:a + n + 2].any()):  # some x_{i+2} in an answer
                out.append((r, a, n))
    return out


def _batch(windows, records, hidden, starts, vocab_index, steps: int = 1, final: int | None = None):
    """Padded tensors of ``windows`` for ``steps`` draft steps (T pairs each, S = ``steps``):
    input states (B, T, W) = h_{a+p} (with the fused layers' states: W columns of ``hidden``), tokens
    (B, T + S - 1) = x_{a+p+1}, target features (B, T + S - 1, H) = h_{a+p+1} (the first ``final``
    = H columns, the final state; default all), target token indices into the drafted vocabulary
    (B, T + S - 1) = x_{a+p+2} (-1: no loss: not an answer token, or past the record), feature mask
    (B, T + S - 1) (h_{a+p+1} exists and predicts an answer token), and which rows hold a pair of
    the window (B, T) (the others are padding: no loss at any step).
    ``vocab_index`` None: no token targets (all -1). ``hidden``: a tensor or :class:`FeatureRows`."""
    T, W = max(n for *_, n in windows), hidden.shape[1]
    B, S, H = len(windows), steps, final or W
    h_in, h_out = torch.zeros(B, T, W, dtype=hidden.dtype), torch.zeros(B, T + S - 1, H, dtype=hidden.dtype)
    tok, tgt = torch.zeros(B, T + S - 1, dtype=torch.long), torch.full((B, T + S - 1), -1, dtype=torch.long)
    feat_mask = torch.zeros(B, T + S - 1, dtype=torch.bool)
    real = torch.zeros(B, T, dtype=torch.bool)
    for b, (r, a, n) in enumerate(windows):
        real[b, :n] = True
        ids, s = records[r]["ids"], int(starts[r])
        answer = answer_mask(records[r])
        m = min(n + S - 1, len(ids) - 1 - a)  # pairs of the window and the steps' lookahead in the record
        rows = hidden[s + a:s + a + m + 1]
        h_in[b, :n] = rows[:n]
        h_out[b, :m] = rows[1:m + 1, :H]
        tok[b, :m] = torch.tensor(ids[a + 1:a + m + 1], dtype=torch.long)
        if vocab_index is not None:
            nxt = torch.tensor(ids[a + 2:a + m + 2], dtype=torch.long)  # x_{i+2}, one shorter at the record's end
            idx = vocab_index[nxt]
            keep = answer[a + 2:a + 2 + nxt.shape[0]]
            tgt[b, :nxt.shape[0]] = torch.where(keep, idx, torch.full_like(idx, -1))
        feat_mask[b, :m] = answer[a + 2:a + m + 2]  # h_{i+1} predicts an answer token
    return h_in, tok, h_out, tgt, feat_mask, real


def window_sample(records: Sequence[dict], features: tuple[torch.Tensor, torch.Tensor], held_out: int,
                  n: int = 8, seq_len: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` training windows spread over the corpus (the ``held_out`` records of
    :func:`split_records` left out): input features (n, T, H) float32 and tokens (n, T), as
    :meth:`EagleModel.forward` reads them."""
    hidden, starts = features
    training = set(split_records(len(records), held_out)[1])
    wins = [w for w in _windows(records, seq_len) if w[0] in training]
    if not wins:
        raise ConfigError("no training windows: the corpus needs records with answers beyond the held-out ones")
    chosen = [wins[i] for i in spread(len(wins), min(n, len(wins)))]
    h_in, tok, *_ = _batch(chosen, records, hidden, starts, None)
    return h_in.float(), tok


def _loss(model: EagleModel, rows: torch.Tensor, batch, cfg: EagleTrainConfig) -> torch.Tensor:
    """Σ over draft steps s of ``step_decay``^(s-1) x (feature_weight x smooth L1 + token_weight x
    CE), each step's terms averaged over its scored positions."""
    h_in, tok, h_out, tgt, feat_mask, real = batch
    T, S = h_in.shape[1], cfg.draft_steps
    if cfg.feature_noise:
        h_in = h_in.float()
        rms = h_in.pow(2).mean(-1, keepdim=True).sqrt()
        h_in = h_in + (torch.rand(h_in.shape) * 2 - 1) * cfg.feature_noise * rms
    total = h_in.new_zeros((), dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision == "bfloat16"):
        for s, f in enumerate(model.unrolled(h_in, tok, S)):  # f: (B, T, H), step s + 1
            m = (feat_mask[:, s:s + T] & real).unsqueeze(-1).to(torch.float32)
            reg = (F.smooth_l1_loss(f.float(), h_out[:, s:s + T].float(), reduction="none") * m).sum() \
                / (m.sum() * f.shape[-1]).clamp(min=1)
            want = tgt[:, s:s + T]
            scored = (want >= 0) & real  # the output layer only where a token is scored (answers, not prompts)
            if scored.any():
                logits = F.linear(f[scored], rows.to(f.dtype)).float()  # (n, V')
                if cfg.token_target == "target":  # the target's own next-token distribution at h_{i+1}
                    with torch.no_grad():
                        teacher = F.linear(h_out[:, s:s + T][scored].to(f.dtype), rows.to(f.dtype)).float()
                    ce = -(teacher.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
                else:
                    ce = F.cross_entropy(logits, want[scored])
            else:
                ce = f.sum() * 0
            total = total + cfg.step_decay ** s * (cfg.feature_weight * reg + cfg.token_weight * ce)
    return total


def _drafted_rows(model: EagleModel) -> tuple[torch.Tensor, torch.Tensor]:
    """The output layer's rows the drafter proposes from (V', H) and each token's index among
    them (V,) (-1 outside)."""
    V = model.config.vocab_size
    vocab = model.draft_vocab if model.draft_vocab is not None else torch.arange(V)
    rows = weights_of(model.output_layer).weight_rows(vocab)
    index = torch.full((V,), -1, dtype=torch.long)
    index[vocab] = torch.arange(vocab.numel())
    return rows, index


@torch.no_grad()
def depth_accuracy(model: EagleModel, records: Sequence[dict], hidden: torch.Tensor, starts: torch.Tensor,
                   depth: int, per_record: int = 16, seed: int = 0,
                   top_k: Sequence[int] = (1,)) -> dict[int, list[float]]:
    """For each k of ``top_k``: acc[d-1], the share of sampled answer positions where the target's
    next d tokens are each among the drafter's top k guesses, the drafter following that path on
    its own features after the first step (one walk serves every k). k = 1: what a greedy chain of
    depth d accepts; larger: what a tree with k children under every node of the path would.
    ``starts[r]``: the first row of ``records[r]`` in ``hidden``."""
    widest = max(top_k)
    hits, total = {k: [0] * depth for k in top_k}, 0
    for r, (rec, sampled) in enumerate(zip(records, answer_positions(records, per_record, seed))):
        ids, s, L = rec["ids"], int(starts[r]), len(rec["ids"])
        cache = EagleCache()
        feats = model.extend(cache, hidden[s:s + L - 1], torch.tensor(ids[1:L]))  # f at pairs 0 .. L-2
        for i in sampled:
            total += 1
            drafting = cache.prefix(i + 1)  # the pairs up to i committed
            state, within = feats[i], set(top_k)  # the k whose path is still whole
            for d in range(depth):
                at = i + 2 + d  # the token this step guesses
                ranked = model.draft_topk(state[None], widest, None)[0].tolist() if at < L else []
                within = {k for k in within if ids[at] in ranked[:k]} if ranked else set()
                if not within:
                    break
                for k in within:
                    hits[k][d] += 1
                if d + 1 < depth:
                    sees = torch.ones(1, drafting.staged, dtype=torch.bool) if drafting.staged else None
                    state = model.tree_step(drafting, sees, state[None], torch.tensor([ids[at]]),
                                            torch.tensor([i + 1 + d]))[0]
    return {k: [h / total if total else 0.0 for h in hits[k]] for k in top_k}


def answer_positions(records: Sequence[dict], per_record: int, seed: int = 0) -> list[list[int]]:
    """For each record, up to ``per_record`` positions i sampled among its answer's (the pair
    (h_i, x_{i+1}) whose next tokens x_{i+2}, ... a drafter guesses): what :func:`depth_accuracy`
    measures, so other drafters can be measured on the same positions."""
    rng = random.Random(seed)
    out = []
    for rec in records:
        answer = answer_mask(rec)
        spots = [i for i in range(len(rec["ids"]) - 2) if bool(answer[i + 2])]
        out.append(rng.sample(spots, min(per_record, len(spots))))
    return out


def train_eagle(model: EagleModel, records: Sequence[dict], features: tuple[torch.Tensor, torch.Tensor],
                out: str | os.PathLike, cfg: EagleTrainConfig, progress: bool = True) -> dict:
    """Train ``model`` (in place) on ``records`` with their ``features`` (:func:`load_features`);
    checkpoints and the report go to ``out``. Returns the report (also ``out/training_report.json``)."""
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    from ..provenance import machine_info
    from ..eagle.checkpoint import save_eagle
    from ..runtime.process import release_memory

    hidden, starts = features
    out_dir = Path(out)
    acc = Accelerator(cpu=True)
    torch.manual_seed(cfg.seed)
    held, train_ids, seen = split_records(len(records), cfg.held_out)
    training = set(train_ids)
    wins = [w for w in _windows(records, cfg.seq_len) if w[0] in training]
    if not wins:
        raise ConfigError("no training windows: the corpus needs records with answers beyond the held-out ones")
    rows, index = _drafted_rows(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (min(1.0, (s + 1) / max(cfg.warmup, 1))
                        * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps))))
    model, opt, sched = acc.prepare(model, opt, sched)
    core = acc.unwrap_model(model)
    ckpts = out_dir / "checkpoints"
    step = 0
    # what the steps took, over every run that resumed this one: wall seconds, CPU seconds of all
    # the processes, and each run's machine (provenance.machine_info)
    spent = {"seconds": 0.0, "cpu_seconds": 0.0, "machines": []}
    done = sorted((p for p in ckpts.glob("step-*") if (p / "step.json").is_file()), key=lambda p: int(p.name[5:]))
    if done:
        acc.load_state(str(done[-1]))
        saved = json.loads((done[-1] / "step.json").read_text())
        step = saved["step"]
        spent.update({k: saved[k] for k in spent if k in saved})
    here = machine_info()
    if here not in spent["machines"]:
        spent["machines"].append(here)
    initial = depth_accuracy(core, [records[r] for r in held], hidden, starts[held],
                             cfg.eval_depth)[1] if held and step == 0 else None
    per_proc = max(1, cfg.batch_size // acc.num_processes)
    losses = []
    bar = tqdm(total=cfg.steps, initial=step, desc="training the EAGLE drafter", disable=not progress)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    seconds0, cpu_seconds0 = spent["seconds"], spent["cpu_seconds"]  # what earlier runs took
    while step < cfg.steps:
        g = random.Random(cfg.seed * 1_000_003 + step)
        chosen = [wins[g.randrange(len(wins))] for _ in range(per_proc * acc.num_processes)]
        mine = chosen[acc.process_index * per_proc:(acc.process_index + 1) * per_proc]
        model.train()
        loss = _loss(core, rows, _batch(mine, records, hidden, starts, index, cfg.draft_steps,
                                        core.config.hidden_size), cfg)
        acc.backward(loss)
        if cfg.max_grad_norm:
            acc.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        step += 1
        if step % _TRIM_EVERY == 0:
            # windows of every length leave the C heap fragmented (blocks under tune_allocator's
            # 64 MB mmap threshold stay in it): unreturned, it grew ~20 MB a step, 6.2 GB by step 170
            release_memory()
        losses.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            cpu = acc.reduce(torch.tensor([time.process_time() - cpu0], dtype=torch.float64), "sum")
            spent["seconds"] = seconds0 + time.perf_counter() - wall0
            spent["cpu_seconds"] = cpu_seconds0 + float(cpu[0])
            target = ckpts / f"step-{step}"
            acc.save_state(str(target))
            if acc.is_main_process:
                (target / "step.json").write_text(json.dumps({"step": step, **spent}))
    bar.close()
    model.eval()
    final = depth_accuracy(core, [records[r] for r in held], hidden, starts[held], cfg.eval_depth,
                           top_k=(1, 4)) if held else {1: [], 4: []}
    # the same measure on as many training records: the gap to the held-out accuracy is what the
    # drafter memorised
    on_train = depth_accuracy(core, [records[r] for r in seen], hidden, starts[seen], cfg.eval_depth)[1] if held else []
    report = {"config": asdict(cfg), "steps": step, "train_loss_last": losses[-10:], "held_out_records": len(held),
              "depth_accuracy_before": initial, "depth_accuracy": final[1],
              "depth_accuracy_top4": final[4], "depth_accuracy_train_records": on_train,
              "train_windows": len(wins), "answer_tokens": sum(int(answer_mask(r)[:-1].sum()) for r in records),
              "train_seconds": round(spent["seconds"], 1), "train_cpu_seconds": round(spent["cpu_seconds"], 1),
              "machines": spent["machines"]}
    if (out_dir / "features").is_dir():  # train-eagle's layout: the features it trained on, beside the checkpoints
        report["features"] = features_cost(out_dir / "features")
    if acc.is_main_process:
        save_eagle(core, out_dir)
        (out_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def split_records(n: int, held_out: int) -> tuple[list[int], list[int], list[int]]:
    """The records of a corpus of n: (held out, trained on, as many of the trained-on to measure
    beside the held-out ones), each spread over the corpus; at least one record is trained on."""
    held = spread(n, min(held_out, max(n - 1, 0)))
    kept = set(held)
    train_ids = [r for r in range(n) if r not in kept]
    return held, train_ids, [train_ids[i] for i in spread(len(train_ids), len(held))]


def spread(n: int, k: int) -> list[int]:
    """k of the indices 0 .. n-1, evenly spread (a corpus is written family by family, so the
    first records would all be of one kind)."""
    return sorted({min(int((j + 0.5) * n / k), n - 1) for j in range(k)}) if k > 0 else []
