"""Token trees: a declarative spec compiled once into the buffers one verification pass needs.

A tree is a set of *paths*; a path is a tuple of child ranks from the root, e.g. ``(0, 1)`` is
"the second candidate proposed after the first candidate". Node 0 is the root: the last token
already decided (not yet in the target's KV cache). Every other node is one drafted token.

    chain of length γ      [[0], [0,0], ..., [0]*γ]
    k-config "4x2x2x1"     4 candidates at depth 1, 2 children each at depth 2, ... (4+8+16+16 nodes)
    list of paths          Medusa-style sparse trees, e.g. [[0], [0,0], [1]]

Nodes are numbered breadth-first (by depth, then by parent, then by rank), so the nodes of one
depth are contiguous and a parent always precedes its children.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

from ..errors import ConfigError

Path = tuple[int, ...]

# the most drafted nodes a tree may have: a pass verifies every node (and builds an n x n mask), and
# past a few dozen rows a pass costs more than the tokens it can add
MAX_TREE_NODES = 1024


def _shown(spec) -> str:
    """``spec`` as an error message quotes it: its repr, cut short if long (a whole file read as one)."""
    text = repr(spec)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class TreeBuffers:
    """A compiled tree of N nodes (root included) and depth D (root has depth 0).

    paths:      N paths, paths[0] == ()                        node i's ranks from the root
    parents:    (N,) long, parents[0] == -1
    depths:     (N,) long                                      position offset of each node
    ranks:      (N,) long, rank among its siblings (root 0)
    mask:       (N, N) bool, mask[i, j] = j is i or an ancestor of i  (tree attention)
    children:   (N, K) long, children[i, r] = node with rank r under i, or -1; K = max fan-out
    levels:     D+1 long tensors, levels[d] = nodes at depth d (contiguous, ascending)
    retrieve:   (L, D+1) long, the root-to-leaf path of each leaf, padded with -1
    """

    paths: tuple[Path, ...]
    parents: torch.Tensor
    depths: torch.Tensor
    ranks: torch.Tensor
    mask: torch.Tensor
    children: torch.Tensor
    levels: tuple[torch.Tensor, ...]
    retrieve: torch.Tensor

    @property
    def size(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return len(self.levels) - 1

    def fanout(self, depth: int) -> int:
        """Largest number of children of a node at ``depth`` (0 for the last level)."""
        if depth >= self.depth:
            return 0
        return int((self.children[self.levels[depth]] >= 0).sum(-1).max())


def normalize_paths(paths: Sequence[Sequence[int]]) -> tuple[Path, ...]:
    """Validate a list of paths (root excluded); return them sorted breadth-first, deduplicated."""
    norm: set[Path] = set()
    for p in paths:
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise ConfigError(f"tree path {p!r} is not a list of child ranks like [0, 1]")
        tp = tuple(p)
        if not tp or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in tp):
            raise ConfigError(f"tree path {list(tp)} must be a non-empty list of ranks >= 0")
        norm.add(tp)
    for p in norm:
        if len(p) > 1 and p[:-1] not in norm:
            raise ConfigError(f"tree path {list(p)} has no parent {list(p[:-1])}: "
                              "every prefix of a path must be in the tree")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in norm:
            raise ConfigError(
                f"tree path {list(p)} skips rank {p[-1] - 1}: sibling ranks must be 0, 1, ... without gaps")
    return tuple(sorted(norm, key=lambda p: (len(p), p)))


def compile_paths(paths: Sequence[Sequence[int]]) -> TreeBuffers:
    """Compile a list of paths (root excluded) into TreeBuffers. Validates the spec."""
    return _compile_cached(normalize_paths(paths))


@lru_cache(maxsize=4096)  # dynamic trees (drafters.dynamic_tree.DynamicTree) take many shapes
def _compile_cached(paths: tuple[Path, ...]) -> TreeBuffers:
    # built in Python lists, one tensor per buffer: a dynamic tree takes a new shape at most steps,
    # and a tensor write per node and ancestor would cost a large share of a drafting step
    ordered: list[Path] = [()] + list(paths)
    index = {p: i for i, p in enumerate(ordered)}
    n = len(ordered)
    parent = [-1] + [index[p[:-1]] for p in ordered[1:]]
    depth = [len(p) for p in ordered]
    lineage: list[list[int]] = [[0]]  # node i's ancestors and itself, root first
    for i in range(1, n):
        lineage.append(lineage[parent[i]] + [i])
    mask = torch.zeros(n, n, dtype=torch.bool)
    rows = [i for i, line in enumerate(lineage) for _ in line]
    mask[rows, [j for line in lineage for j in line]] = True
    fan = max([p[-1] + 1 for p in ordered[1:]], default=0)
    kids = [[-1] * max(fan, 1) for _ in range(n)]
    for i in range(1, n):
        kids[parent[i]][ordered[i][-1]] = i
    max_depth = max(depth)
    by_depth: list[list[int]] = [[] for _ in range(max_depth + 1)]
    for i, d in enumerate(depth):
        by_depth[d].append(i)
    leaves = [i for i in range(n) if kids[i][0] < 0]
    retrieve = [lineage[i] + [-1] * (max_depth + 1 - len(lineage[i])) for i in leaves]
    return TreeBuffers(tuple(ordered), torch.tensor(parent, dtype=torch.long), torch.tensor(depth, dtype=torch.long),
                       torch.tensor([p[-1] if p else 0 for p in ordered], dtype=torch.long), mask,
                       torch.tensor(kids, dtype=torch.long),
                       tuple(torch.tensor(level, dtype=torch.long) for level in by_depth),
                       torch.tensor(retrieve, dtype=torch.long).view(len(leaves), max_depth + 1))


def chain_paths(gamma: int) -> list[Path]:
    """A chain of γ drafted tokens."""
    if gamma < 0:
        raise ConfigError(f"draft length gamma must be >= 0, got {gamma}")
    return [(0,) * d for d in range(1, gamma + 1)]


def kconfig_paths(ks: Sequence[int]) -> list[Path]:
    """k-config (MCSD): ks[d] candidates under every node of depth d, e.g. (4, 2, 2, 1)."""
    out: list[Path] = []
    frontier: list[Path] = [()]
    for k in ks:
        frontier = [p + (r,) for p in frontier for r in range(k)]
        out.extend(frontier)
    return out


def parse_tree_spec(spec: str | Sequence[Sequence[int]]) -> list[Path]:
    """Parse ``"4x2x2x1"``, a bare integer γ (chain), a JSON list of paths, or a list of paths."""
    if not isinstance(spec, str):
        return list(spec)
    s = spec.strip()
    if s.startswith("["):
        try:
            value = json.loads(s)
        except json.JSONDecodeError as e:
            raise ConfigError(f"tree spec {_shown(spec)} is not valid JSON ({e}); expected e.g. "
                              "[[0],[0,0],[1]]") from None
        if not isinstance(value, list):
            raise ConfigError(f"tree spec {_shown(spec)} must be a JSON list of paths, e.g. [[0],[0,0],[1]]")
        return value
    parts = s.lower().split("x")
    try:
        ks = [int(k) for k in parts]
    except ValueError:
        raise ConfigError(
            f"malformed tree spec {_shown(spec)}: use a k-config like 4x2x2x1 (candidates per depth), "
            "or a JSON list of paths like [[0],[0,0],[1]]") from None
    if not ks or any(k < 1 for k in ks):
        raise ConfigError(f"malformed tree spec {_shown(spec)}: every factor of a k-config must be >= 1")
    nodes, width = 0, 1
    for k in ks:  # counted before the paths are made
        width *= k
        nodes += width
        if nodes > MAX_TREE_NODES:
            raise ConfigError(f"tree spec {_shown(spec)} has more than {MAX_TREE_NODES} nodes (a pass verifies "
                              "every one): use fewer or smaller factors, e.g. 4x2x2x1")
    if len(ks) == 1:
        return chain_paths(ks[0]) if ks[0] > 0 else []
    return kconfig_paths(ks)


def build_tree(spec: str | Sequence[Sequence[int]]) -> TreeBuffers:
    """Parse and compile a tree spec (compiled trees are cached by their paths)."""
    paths = parse_tree_spec(spec)
    if not paths:
        raise ConfigError(f"tree spec {_shown(spec)} has no nodes")
    if len(paths) > MAX_TREE_NODES:
        raise ConfigError(f"tree spec {_shown(spec)} has {len(paths)} nodes, more than {MAX_TREE_NODES} (a pass "
                          "verifies every one): give a smaller tree")
    return compile_paths(paths)


def chain(gamma: int) -> TreeBuffers:
    """A compiled chain (γ = 0 gives the root alone: plain decoding)."""
    return compile_paths(chain_paths(gamma))
