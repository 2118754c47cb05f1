"""The target's features for training an EAGLE drafter: its final hidden states at every position
of every record of a corpus, computed once (:func:`compute_features`, resumable shard by shard) and
read back lazily (:func:`load_features`, :class:`FeatureRows`).

Shapes: N rows in all (every record's tokens, in order), H the target's hidden size, W the width of
a row: H (1 + k) with k tapped layers (the final normed state, then the residual stream entering each
of ``layers``: EAGLE-3's low- and mid-level features).
"""

from __future__ import annotations

import bisect
import hashlib
import os
import time
from pathlib import Path
from typing import Sequence

import torch

from ..backends.base import Backend, ForwardRequest, HiddenNeed, forward_batch
from ..errors import ConfigError

__all__ = ["FeatureRows", "FirstColumns", "compute_features", "features_cost", "load_features"]


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
                     shard_records: int = 256, rows_per_pass: int = 1024, progress: bool = True,
                     layers: Sequence[int] = ()) -> Path:
    """The target's final hidden states (and the states entering ``layers``) at every position of
    ``records`` (their ``ids``) through
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
    layers = tuple(int(i) for i in layers)
    spans = _shards(len(records), shard_records)
    bar = tqdm(total=len(records), desc="target features", unit="record", disable=not progress)
    pool: list[Backend] = [backend]
    for a, b in spans:
        path, mark = out / f"shard-{a:07d}.safetensors", _fingerprint(records[a:b])
        if path.is_file():
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            if meta.get("records") == mark and meta.get("count") == str(b - a) and _layers(meta) == layers:
                bar.update(b - a)
                continue
        rows, wall0, cpu0 = [], time.perf_counter(), time.process_time()
        for group in _passes(records[a:b], rows_per_pass):
            while len(pool) < len(group):
                pool.append(backend.sibling())
            for be in pool:
                be.reset()
            reqs = [ForwardRequest(torch.tensor(r["ids"], dtype=torch.long), rows=torch.empty(0, dtype=torch.long),
                                   want_hidden=HiddenNeed.ALL, layers=layers, prefill=True) for r in group]
            rows += [o.hidden.to(torch.bfloat16) for o in forward_batch(pool[:len(group)], reqs)]
            bar.update(len(group))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        took = {"seconds": f"{time.perf_counter() - wall0:.3f}", "cpu_seconds": f"{time.process_time() - cpu0:.3f}"}
        save_file({"hidden": torch.cat(rows).contiguous()}, str(tmp),
                  metadata={"records": mark, "count": str(b - a), "layers": ",".join(map(str, layers)), **took})
        os.replace(tmp, path)
    bar.close()
    for be in pool:
        be.reset()
    return out


def _layers(meta: dict) -> tuple[int, ...]:
    """The tapped layers a shard's metadata names (none in shards written before taps existed)."""
    return tuple(int(i) for i in meta.get("layers", "").split(",") if i)


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


class FeatureRows:
    """The rows of a features directory (:func:`compute_features`) as one (N, H) bf16 table, read
    from the shards' files when sliced (memory-mapped: the page cache, not the process, holds
    them, so a corpus of millions of rows trains in a machine's memory). ``rows[a:b]`` is a tensor;
    a slice may span shards; ``rows[i]`` one row (H,)."""

    def __init__(self, parts: list[tuple[int, int, object]], width: int, dtype: torch.dtype,
                 handles: Sequence[object] = ()):
        self._parts = parts  # (first row, end row, safetensors slice) in order
        self._handles = list(handles)  # the open files the slices read
        self._ends = [b for _, b, _ in parts]
        self.shape = torch.Size((parts[-1][1] if parts else 0, width))
        self.dtype = dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> torch.Tensor:
        if isinstance(key, (int, torch.Tensor)) and not isinstance(key, bool):
            i = int(key) + (self.shape[0] if int(key) < 0 else 0)
            if not 0 <= i < self.shape[0]:
                raise IndexError(f"row {int(key)} of {self.shape[0]}")
            return self[i:i + 1][0]
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("feature rows are read by a row or contiguous slices: rows[i], rows[a:b]")
        a, b, _ = key.indices(self.shape[0])
        out, k = [], bisect.bisect_right(self._ends, a)
        while a < b and k < len(self._parts):
            first, end, part = self._parts[k]
            take = min(b, end)
            out.append(part[a - first:take - first])
            a, k = take, k + 1
        if not out:
            return torch.empty(0, self.shape[1], dtype=self.dtype)
        return out[0] if len(out) == 1 else torch.cat(out)


class FirstColumns:
    """The first ``width`` columns of a (N, W) table (a tensor or :class:`FeatureRows`), read as
    the table is: ``cols[a:b]`` (b - a, width), ``cols[i]`` (width,). The final states alone of
    rows that also hold fused layers' states, for a drafter that reads only those."""

    def __init__(self, rows, width: int):
        self.rows, self.shape, self.dtype = rows, torch.Size((rows.shape[0], width)), rows.dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> torch.Tensor:
        return self.rows[key][..., :self.shape[1]]


def load_features(out_dir: str | os.PathLike, records: Sequence[dict],
                  layers: Sequence[int] = ()) -> tuple[FeatureRows, torch.Tensor]:
    """(hidden (N, W) bf16 :class:`FeatureRows`, starts (R + 1,)) of :func:`compute_features` over
    ``records`` with ``layers`` tapped: record r's rows are ``starts[r] .. starts[r+1]-1``. Features
    of more layers, of which ``layers`` are the first, serve too (their first W columns:
    :class:`FirstColumns`), e.g. the final states alone for a drafter without fusion. Raises
    ConfigError when a shard is missing or was computed for other records or other layers."""
    from safetensors import safe_open

    out = Path(out_dir)
    lengths = torch.tensor([len(r["ids"]) for r in records], dtype=torch.long)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    parts, handles, a, width, dtype, stored = [], [], 0, 0, torch.bfloat16, None
    while a < len(records):
        path = out / f"shard-{a:07d}.safetensors"
        if not path.is_file():
            raise ConfigError(f"{out} has no features from record {a} on: compute the features (again)")
        f = safe_open(str(path), "pt")
        meta = f.metadata() or {}
        b = a + int(meta.get("count", 0))
        if b <= a or b > len(records) or meta.get("records") != _fingerprint(records[a:b]):
            raise ConfigError(f"{path} was computed for other records: compute the features again")
        here = _layers(meta)
        if here[:len(layers)] != tuple(layers) or stored not in (None, here):
            raise ConfigError(f"{path} holds the states entering layers {list(here)}, the drafter reads "
                              f"layers {list(layers)}: compute the features again")
        stored = here
        part = f.get_slice("hidden")
        rows, width = part.get_shape()
        if rows != int(starts[b] - starts[a]):
            raise ConfigError(f"{path} holds {rows} rows where its records have {int(starts[b] - starts[a])}: "
                              "compute the features again")
        dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}.get(part.get_dtype(), dtype)
        parts.append((int(starts[a]), int(starts[b]), part))
        handles.append(f)
        a = b
    if not parts:
        raise ConfigError(f"{out} holds no features: compute them first")
    rows = FeatureRows(parts, width, dtype, handles)
    if len(stored) > len(layers):  # the first columns: the final state and the first len(layers) taps
        rows = FirstColumns(rows, width // (1 + len(stored)) * (1 + len(layers)))
    return rows, starts
