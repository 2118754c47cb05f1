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

import hashlib
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

from ..backends.base import Backend, ForwardRequest, HiddenNeed, forward_batch
from ..errors import ConfigError
from .model import EagleCache, EagleModel

__all__ = ["EagleTrainConfig", "answer_positions", "compute_features", "depth_accuracy", "features_cost",
           "load_features", "split_records", "train_eagle", "training_precision", "window_sample"]


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
        if self.precision == "auto":
            object.__setattr__(self, "precision", training_precision())


def training_precision() -> str:
    """"bfloat16" where the CPU multiplies bf16 natively (AVX512-BF16, which every AMX CPU also
    has), else "float32"."""
    from ..kernels import cpu_has_avx512_bf16

    return "bfloat16" if cpu_has_avx512_bf16() else "float32"


def _fingerprint(records: Sequence[dict]) -> str:
    """A digest of the records' token ids: a feature shard is reused only for the records it was
    computed for."""
    h = hashlib.sha256()
    for rec in records:
        h.update(len(rec["ids"]).to_bytes(4, "little"))
        h.update(torch.tensor(rec["ids"], dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()[:16]


def _shards(n: int, shard_records: int) -> list[tuple[int, int]]:
    return [(a, min(a + shard_records, n)) for a in range(0, n, shard_records)]


def _passes(records: Sequence[dict], rows_per_pass: int):
    """``records`` in order, in groups of up to ``rows_per_pass`` tokens (a longer record alone)."""
    group, rows = [], 0
    for rec in records:
        if group and rows + len(rec["ids"]) > rows_per_pass:
            yield group
            group, rows = [], 0
        group.append(rec)
        rows += len(rec["ids"])
    if group:
        yield group


@torch.no_grad()
def compute_features(backend: Backend, records: Sequence[dict], out_dir: str | os.PathLike,
                     shard_records: int = 256, rows_per_pass: int = 1024, progress: bool = True) -> Path:
    """The target's final hidden states at every position of ``records`` (their ``ids``) through
    ``backend`` (prompt passes of several records, up to ``rows_per_pass`` rows, on siblings of
    ``backend``: a runtime may take its prefill kernels), into
    safetensors shards of ``shard_records`` records under ``out_dir``. Each shard is written whole
    and moved in place, so a stopped run resumes at the first shard missing; a shard computed for
    other records is computed again. Each shard's metadata also holds what it took (``seconds``,
    ``cpu_seconds``: :func:`features_cost`)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spans = _shards(len(records), shard_records)
    bar = tqdm(total=len(records), desc="target features", unit="record", disable=not progress)
    pool: list[Backend] = [backend]
    for a, b in spans:
        path, mark = out / f"shard-{a:07d}.safetensors", _fingerprint(records[a:b])
        if path.is_file():
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            if meta.get("records") == mark and meta.get("count") == str(b - a):
                bar.update(b - a)
                continue
        rows, wall0, cpu0 = [], time.perf_counter(), time.process_time()
        for group in _passes(records[a:b], rows_per_pass):
            while len(pool) < len(group):
                pool.append(backend.sibling())
            for be in pool:
                be.reset()
            reqs = [ForwardRequest(torch.tensor(r["ids"], dtype=torch.long), rows=torch.empty(0, dtype=torch.long),
                                   want_hidden=HiddenNeed.ALL, prefill=True) for r in group]
            rows += [o.hidden.to(torch.bfloat16) for o in forward_batch(pool[:len(group)], reqs)]
            bar.update(len(group))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        took = {"seconds": f"{time.perf_counter() - wall0:.3f}", "cpu_seconds": f"{time.process_time() - cpu0:.3f}"}
        save_file({"hidden": torch.cat(rows).contiguous()}, str(tmp),
                  metadata={"records": mark, "count": str(b - a), **took})
        os.replace(tmp, path)
    bar.close()
    for be in pool:
        be.reset()
    return out


def features_cost(out_dir: str | os.PathLike) -> dict:
    """What computing the features under ``out_dir`` took, summed over its shards: ``seconds``
    and ``cpu_seconds`` (None when a shard does not say: written by an earlier version) and
    ``shards``."""
    from safetensors import safe_open

    paths = sorted(Path(out_dir).glob("shard-*.safetensors"))
    metas = []
    for path in paths:
        with safe_open(str(path), "pt") as f:
            metas.append(f.metadata() or {})
    total = {k: (round(sum(float(m[k]) for m in metas), 3) if metas and all(k in m for m in metas) else None)
             for k in ("seconds", "cpu_seconds")}
    return {**total, "shards": len(paths)}


def load_features(out_dir: str | os.PathLike, records: Sequence[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden (N, H) bf16, starts (R + 1,)) of :func:`compute_features` over ``records``: record r's
    rows are ``starts[r] .. starts[r+1]-1``. Raises ConfigError when a shard is missing or was
    computed for other records."""
    from safetensors import safe_open

    out = Path(out_dir)
    lengths = torch.tensor([len(r["ids"]) for r in records], dtype=torch.long)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    hidden, a = None, 0
    while a < len(records):
        path = out / f"shard-{a:07d}.safetensors"
        if not path.is_file():
            raise ConfigError(f"{out} has no features from record {a} on: compute the features (again)")
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            b = a + int(meta.get("count", 0))
            if b <= a or b > len(records) or meta.get("records") != _fingerprint(records[a:b]):
                raise ConfigError(f"{path} was computed for other records: compute the features again")
            part = f.get_tensor("hidden")
        if hidden is None:
            hidden = torch.empty(int(starts[-1]), part.shape[1], dtype=part.dtype)
        hidden[starts[a]:starts[b]] = part
        a = b
    if hidden is None:
        raise ConfigError(f"{out} holds no features: compute them first")
    return hidden, starts


def _windows(records: Sequence[dict], seq_len: int) -> list[tuple[int, int, int]]:
    """(record, first pair, pairs) windows of at most ``seq_len`` pairs that hold answer targets."""
    out = []
    for r, rec in enumerate(records):
        pairs = len(rec["ids"]) - 1  # pair i = (h_i, x_{i+1}), i < L - 1
        for a in range(0, pairs, seq_len):
            n = min(seq_len, pairs - a)
            if a + n + 1 > rec["prompt_len"]:  # some x_{i+2} in the answer
                out.append((r, a, n))
    return out


def _batch(windows, records, hidden, starts, vocab_index, steps: int = 1):
    """Padded tensors of ``windows`` for ``steps`` draft steps (T pairs each, S = ``steps``):
    input features (B, T, H) = h_{a+p}, tokens (B, T + S - 1) = x_{a+p+1}, target features
    (B, T + S - 1, H) = h_{a+p+1}, target token indices into the drafted vocabulary
    (B, T + S - 1) = x_{a+p+2} (-1: no loss: prompt or past the record), feature mask
    (B, T + S - 1) (h_{a+p+1} exists and is an answer's, or the last prompt position's), and which
    rows hold a pair of the window (B, T) (the others are padding: no loss at any step).
    ``vocab_index`` None: no token targets (all -1)."""
    T, H = max(n for *_, n in windows), hidden.shape[1]
    B, S = len(windows), steps
    h_in, h_out = torch.zeros(B, T, H, dtype=hidden.dtype), torch.zeros(B, T + S - 1, H, dtype=hidden.dtype)
    tok, tgt = torch.zeros(B, T + S - 1, dtype=torch.long), torch.full((B, T + S - 1), -1, dtype=torch.long)
    feat_mask = torch.zeros(B, T + S - 1, dtype=torch.bool)
    real = torch.zeros(B, T, dtype=torch.bool)
    for b, (r, a, n) in enumerate(windows):
        real[b, :n] = True
        ids, s, P = records[r]["ids"], int(starts[r]), records[r]["prompt_len"]
        m = min(n + S - 1, len(ids) - 1 - a)  # pairs of the window and the steps' lookahead in the record
        h_in[b, :n] = hidden[s + a:s + a + n]
        h_out[b, :m] = hidden[s + a + 1:s + a + m + 1]
        tok[b, :m] = torch.tensor(ids[a + 1:a + m + 1], dtype=torch.long)
        if vocab_index is not None:
            nxt = torch.tensor(ids[a + 2:a + m + 2], dtype=torch.long)  # x_{i+2}, one shorter at the record's end
            pos = torch.arange(a + 2, a + 2 + nxt.shape[0])
            idx = vocab_index[nxt]
            tgt[b, :nxt.shape[0]] = torch.where(pos >= P, idx, torch.full_like(idx, -1))
        feat_mask[b, :m] = torch.arange(a + 1, a + m + 1) >= P - 1  # h_{i+1} of the answer's positions
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
                ce = F.cross_entropy(logits, want[scored])
            else:
                ce = f.sum() * 0
            total = total + cfg.step_decay ** s * (cfg.feature_weight * reg + cfg.token_weight * ce)
    return total


def _drafted_rows(model: EagleModel) -> tuple[torch.Tensor, torch.Tensor]:
    """The output layer's rows the drafter proposes from (V', H) and each token's index among
    them (V,) (-1 outside)."""
    layer = model._shared[0]
    V = model.config.vocab_size
    vocab = model.draft_vocab if model.draft_vocab is not None else torch.arange(V)
    weight = getattr(layer, "weight", None)
    rows = weight.detach()[vocab] if weight is not None else layer.dequantize_rows(vocab)
    index = torch.full((V,), -1, dtype=torch.long)
    index[vocab] = torch.arange(vocab.numel())
    return rows, index


@torch.no_grad()
def depth_accuracy(model: EagleModel, records: Sequence[dict], hidden: torch.Tensor, starts: torch.Tensor,
                   depth: int, per_record: int = 16, seed: int = 0, top_k: Sequence[int] = (1,)) -> dict[int, list[float]]:
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
        spots = list(range(max(rec["prompt_len"] - 2, 0), len(rec["ids"]) - 2))
        out.append(rng.sample(spots, min(per_record, len(spots))))
    return out


def train_eagle(model: EagleModel, records: Sequence[dict], features: tuple[torch.Tensor, torch.Tensor],
                out: str | os.PathLike, cfg: EagleTrainConfig, progress: bool = True) -> dict:
    """Train ``model`` (in place) on ``records`` with their ``features`` (:func:`load_features`);
    checkpoints and the report go to ``out``. Returns the report (also ``out/training_report.json``)."""
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    from ..bench.harness import machine_info
    from .checkpoint import save_eagle

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
        opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup, 1)) * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    model, opt, sched = acc.prepare(model, opt, sched)
    core = acc.unwrap_model(model)
    ckpts = out_dir / "checkpoints"
    step = 0
    # what the steps took, over every run that resumed this one: wall seconds, CPU seconds of all
    # the processes, and each run's machine (bench.harness.machine_info)
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
        loss = _loss(core, rows, _batch(mine, records, hidden, starts, index, cfg.draft_steps), cfg)
        acc.backward(loss)
        if cfg.max_grad_norm:
            acc.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        step += 1
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
              "train_windows": len(wins), "answer_tokens": sum(len(r["ids"]) - r["prompt_len"] for r in records),
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
