"""A dynamic tree's settings (:class:`DynamicTree`): how the heads' drafter grows a tree anew at
every step (``drafters.dynamic_tree``), parsed from a ``--tree dynamic...`` spec."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .buffers import MAX_TREE_NODES

__all__ = ["DynamicTree"]


@dataclass(frozen=True)
class DynamicTree:
    """A draft tree grown anew at every step from the heads' own probabilities (EAGLE-2's
    context-aware dynamic tree, Li et al. 2024).

    Each drafted node gets the score ``Π p(token | path)`` along its path (the heads' estimate of
    the chance that the target accepts the whole path). Depth by depth, the ``beam`` best-scored
    nodes of the last depth are expanded, each with its ``top_k`` best children; after ``depth``
    depths the ``nodes`` best-scored nodes of all those drafted make the tree (a child never
    scores above its parent, so the set is closed under ancestors). A static tree spends its
    nodes where the heads are right on average; this one where they are confident right now.
    Medusa heads (one candidate list per depth, shared by every parent) need no beam: every
    path's score is known from one call, and the best ``nodes`` are found best-first.
    """

    nodes: int = 15  # + the root: 16 rows. Why: docs/design-notes.md#tree-rows
    depth: int = 0  # 0: as deep as the heads go (K)
    # Why 16 children and a beam of 4: docs/design-notes.md#dynamic-tree-beam
    top_k: int = 16
    beam: int = 4

    def __post_init__(self) -> None:
        for name in ("nodes", "depth", "top_k", "beam"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "depth" else 1):
                raise ConfigError(f"dynamic tree {name} must be an integer >= {0 if name == 'depth' else 1}, "
                                  f"got {value!r}")
        if self.nodes > MAX_TREE_NODES:
            raise ConfigError(f"a dynamic tree of {self.nodes} nodes: at most {MAX_TREE_NODES} (a pass verifies "
                              "every one), e.g. dynamic:32")

    @classmethod
    def parse(cls, spec: str) -> "DynamicTree":
        """``"dynamic"``, ``"dynamic:N"`` (N nodes) or ``"dynamic:N:D"`` (and depth D)."""
        parts = spec.strip().lower().split(":")
        if parts[0] != "dynamic" or len(parts) > 3:
            raise ConfigError(f"malformed dynamic tree {spec!r}: use dynamic, dynamic:N (nodes) or dynamic:N:D "
                              "(nodes, depth)")
        try:
            nums = [int(x) for x in parts[1:]]
        except ValueError:
            raise ConfigError(f"malformed dynamic tree {spec!r}: N and D must be integers, e.g. dynamic:20:4") from None
        return cls(*nums)
