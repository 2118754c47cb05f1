"""Recycled predictions (Token Recycling, Luo et al. 2024): every verification pass computes the
target's distribution after every node it verifies and keeps only what the path needs; the top k
next tokens after each node are kept instead, in a table (V, k) int32 indexed by the node's token
(the latest pass overwrites a token's row), shared by every generation of a decoder
(:class:`RecycledTable`), saved per model under ``$SPECULANT_CACHE/drafts/`` and warmable by
prefill over real conversations (``speculant warm-drafts``). A draft tree is grown from it
best-first: a node's children are its token's row, rank r at depth d scored by the observed rate
at which that rank is the target's choice (``hits / offered``, with a prior), the path's score the
product (:class:`RecyclingDrafter`); the suffix match's chain (``drafters.suffix``) is merged in.

Deterministic: the target verifies every token, so the output is that of plain decoding.
"""

from __future__ import annotations

import heapq
import os
import sys
import time
from pathlib import Path

import torch

from ..errors import ConfigError
from ..trees.buffers import TreeBuffers, chain
from ..trees.draft import Draft
from .base import HiddenNeed, ProposesAlone
from .dynamic_tree import sized_merge
from .suffix import AnswerStore, SuffixSource

__all__ = ["RecycledTable", "RecyclingDrafter", "table_path"]

DEFAULT_K = 8
MAX_DEPTH = 8  # the deepest a table tree grows
FORMAT = 1
PRIOR = (0.4, 0.12, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01)  # P(rank r is the target's choice), before evidence
PRIOR_WEIGHT = 20.0
SAVE_EVERY_S = 60.0  # at most one save of a changed table per this many seconds (at a generation's end)


def table_path(model_name: str, model_path: str, vocab_size: int, k: int) -> Path:
    """Where the table of a model is kept: ``$SPECULANT_CACHE/drafts/<name>-<hash>-v<V>-k<k>.pt``."""
    import hashlib

    from ..runtime.process import cache_dir

    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)[:64]
    digest = hashlib.sha256(str(model_path).encode()).hexdigest()[:10]
    return cache_dir() / "drafts" / f"{slug}-{digest}-v{vocab_size}-k{k}.pt"


class RecycledTable:
    """The target's top-k next tokens per token: ``rows`` (V, k) int32, -1 where a token was never
    verified; ``hits`` / ``offered`` (MAX_DEPTH, k) float64: how often rank r at depth d was the
    accepted child / was verified under an accepted parent. V k 4 bytes (4.9 MB for 152k tokens
    and k = 8), whatever is decoded. ``path``: where it is saved (None: not saved)."""

    def __init__(self, vocab_size: int, k: int = DEFAULT_K, path: Path | None = None):
        if vocab_size < 1 or k < 1:
            raise ConfigError(f"a recycled table needs vocab_size >= 1 and k >= 1, got {vocab_size}, {k}")
        self.V, self.k, self.path = vocab_size, k, path
        self.rows = torch.full((vocab_size, k), -1, dtype=torch.int32)
        self.hits = torch.zeros(MAX_DEPTH, k, dtype=torch.float64)
        self.offered = torch.zeros(MAX_DEPTH, k, dtype=torch.float64)
        self.updates = 0
        self._saved_at = time.monotonic()

    @classmethod
    def load_or_new(cls, vocab_size: int, k: int = DEFAULT_K, path: Path | None = None) -> "RecycledTable":
        """The table saved at ``path`` if there is one of this shape; a damaged or mismatched file
        is ignored with a warning (a new, empty table)."""
        table = cls(vocab_size, k, path)
        if path is None or not Path(path).exists():
            return table
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            rows, hits, offered = saved["rows"], saved["hits"], saved["offered"]
            if saved.get("format") != FORMAT or tuple(rows.shape) != (vocab_size, k) or rows.dtype != torch.int32 \
                    or tuple(hits.shape) != (MAX_DEPTH, k) or tuple(offered.shape) != (MAX_DEPTH, k):
                raise ValueError(f"shape {tuple(rows.shape)}, expected {(vocab_size, k)}")
            if rows.numel() and (int(rows.min()) < -1 or int(rows.max()) >= vocab_size):
                raise ValueError("token ids outside the vocabulary")
            table.rows, table.hits, table.offered = rows.clone(), hits.double(), offered.double()
        except Exception as e:  # noqa: BLE001 - any damage: start empty, say so
            print(f"speculant: warning: ignoring the recycled-draft table {path} ({type(e).__name__}: {e}); "
                  "starting from an empty one", file=sys.stderr, flush=True)
        return table

    def save(self, path: Path | None = None) -> Path | None:
        """Write the table atomically (a temporary file, then a rename); returns where, or None."""
        path = Path(path) if path is not None else self.path
        if path is None:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save({"format": FORMAT, "rows": self.rows, "hits": self.hits, "offered": self.offered}, tmp)
        os.replace(tmp, path)
        self._saved_at = time.monotonic()
        return path

    def maybe_save(self) -> None:
        """Save if it changed and the last save is SAVE_EVERY_S old (a failed write only warns)."""
        if self.path is None or not self.updates or time.monotonic() - self._saved_at < SAVE_EVERY_S:
            return
        try:
            self.save()
            self.updates = 0
        except OSError as e:
            print(f"speculant: warning: could not save the recycled-draft table ({e})", file=sys.stderr, flush=True)

    @property
    def filled(self) -> int:
        """Tokens whose row has been written."""
        return int((self.rows[:, 0] >= 0).sum())

    def update(self, tokens: torch.Tensor, topk: torch.Tensor) -> None:
        """tokens (N,) long, topk (N, k') long: the target's top-k' after each token (k' >= k;
        the first k kept). A token seen twice keeps the later row."""
        if topk.shape[0] != tokens.shape[0] or topk.shape[1] < self.k:
            raise ValueError(f"need topk (N, >= {self.k}) for tokens (N,), got {tuple(topk.shape)}, "
                             f"{tuple(tokens.shape)}")
        keep = (tokens >= 0) & (tokens < self.V)
        self.rows[tokens[keep]] = topk[keep, :self.k].to(torch.int32)
        self.updates += 1

    def rank_scores(self) -> list[list[float]]:
        """log P(rank r is the target's choice | parent accepted) per depth (MAX_DEPTH, k), from the
        counts and the prior, made non-increasing along the ranks."""
        prior = torch.tensor([PRIOR[r] if r < len(PRIOR) else PRIOR[-1] for r in range(self.k)], dtype=torch.float64)
        acc = (self.hits + PRIOR_WEIGHT * prior) / (self.offered + PRIOR_WEIGHT)
        acc = torch.cummin(acc.clamp(1e-6, 1.0), dim=1).values
        return acc.log().tolist()

    def observe(self, ranks_offered: list[tuple[int, int]], rank_hit: list[tuple[int, int]]) -> None:
        """(depth index, rank) pairs verified under an accepted parent, and those accepted."""
        for d, r in ranks_offered:
            self.offered[d, r] += 1
        for d, r in rank_hit:
            self.hits[d, r] += 1
        if float(self.offered[0].sum()) > 1e5:  # follow the text: halve old evidence
            self.hits *= 0.5
            self.offered *= 0.5

    def grow(self, root: int, nodes: int,
             depth: int = MAX_DEPTH) -> tuple[list[tuple[int, ...]], list[int], list[float]]:
        """The best ``nodes`` nodes under ``root`` (paths of ranks, tokens, log-scores), best first
        (every prefix a tree: a rank's next sibling is pushed only once it is taken)."""
        scores = self.rank_scores()
        rows = self.rows
        out_paths: list[tuple[int, ...]] = []
        out_tokens: list[int] = []
        out_scores: list[float] = []
        first = rows[root].tolist() if 0 <= root < self.V else [-1]
        if first[0] < 0 or nodes < 1:
            return out_paths, out_tokens, out_scores
        # (-score, path, the parent's row)
        heap: list[tuple[float, tuple[int, ...], list[int]]] = [(-scores[0][0], (0,), first)]
        while heap and len(out_paths) < nodes:
            neg, path, parent_row = heapq.heappop(heap)
            d, r = len(path) - 1, path[-1]
            tok = parent_row[r]
            out_paths.append(path)
            out_tokens.append(tok)
            out_scores.append(-neg)
            if r + 1 < self.k:  # the next sibling
                heapq.heappush(heap, (neg + scores[d][r] - scores[d][r + 1], path[:-1] + (r + 1,), parent_row))
            if d + 1 < min(depth, MAX_DEPTH):
                row = rows[tok].tolist()
                if row[0] >= 0:  # the first child
                    heapq.heappush(heap, (neg - scores[d + 1][0], path + (0,), row))
        return out_paths, out_tokens, out_scores


class RecyclingDrafter(ProposesAlone):
    """A tree from the :class:`RecycledTable` plus the suffix match's chain (``suffix``; None: the
    table alone), the split of rows between them taken by the ``sizer`` (``tuning.sizing``) for
    the most expected tokens per millisecond, else ``nodes`` table nodes and up to ``gamma`` chain
    rows. Learns from every pass (``topk_need``, ``observe_pass``)."""

    hidden_need = HiddenNeed.NONE
    hidden_layers = ()

    def __init__(self, table: RecycledTable, suffix: AnswerStore | None | bool = True, gamma: int = 8,
                 nodes: int = 15, sizer=None, min_match: int = 2):
        self.table, self.gamma, self.nodes, self.sizer, self.min_match = table, gamma, nodes, sizer, min_match
        self.topk_need = table.k
        self.use_suffix = suffix is not False
        self.store = suffix if isinstance(suffix, AnswerStore) else None
        self.source = SuffixSource(self.store) if self.use_suffix else None
        self._prompt_len = 0
        self._tree: TreeBuffers | None = None  # the last draft's tree and its table nodes {path: (depth index, rank)}
        self._table_nodes: dict[tuple[int, ...], tuple[int, int]] = {}

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        self._prompt_len = int(prompt.shape[0])
        if self.use_suffix:
            self.source = SuffixSource(self.store)
            self.source.sync(prompt.tolist())

    def propose(self, context: torch.Tensor) -> Draft:
        root = context[-1:]
        budget = self.nodes + self.gamma
        paths, toks, scores = self.table.grow(int(root[0]), budget)
        cont: list[int] = []
        if self.source is not None:
            self.source.sync(context.tolist())
            cont, _ = self.source.best(self.gamma, self.min_match)
        if not paths and not cont:
            self._tree = None
            return Draft(chain(0), root.clone())
        tree, tokens, _, m = sized_merge(self.sizer, root, paths, toks, scores, cont, budget, int(context.shape[0]))
        self._tree = tree
        self._table_nodes = {p: (len(p) - 1, p[-1]) for p in paths[:m]}
        return Draft(tree, tokens)

    def observe_pass(self, node_tokens: torch.Tensor, topk: torch.Tensor) -> None:
        self.table.update(node_tokens, topk)

    def observe(self, path: list[int], next_token: int, hidden: torch.Tensor | None = None) -> None:
        if self.sizer is not None:
            self.sizer.observe(path)
        tree, self._tree = self._tree, None
        if tree is None or not self._table_nodes:
            return
        offered, hit = [], []
        on_path = [tree.paths[i] for i in path]
        for d, parent in enumerate(on_path):
            below = [(q, dr) for q, dr in self._table_nodes.items() if len(q) == d + 1 and q[:-1] == parent]
            offered += [dr for _, dr in below]
            if d + 1 < len(on_path) and on_path[d + 1] in self._table_nodes:
                hit.append(self._table_nodes[on_path[d + 1]])
        self.table.observe(offered, hit)

    def finish(self, context: torch.Tensor) -> None:
        if self.store is not None:
            self.store.add(context[self._prompt_len:].tolist())
        self.table.maybe_save()
