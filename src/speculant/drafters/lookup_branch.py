"""The prompt-lookup chain as one more branch of the heads' tree, shared by the static and the
dynamic tree drafters.

The chain is the tokens that followed the latest earlier occurrence of the context's last n-gram
(``LookupDrafter.find``). It costs tree rows and pays on text that copies its context (summaries,
retrieval-augmented answers, code edits).

Static tree (:class:`LookupBranch`): ``lookup.gamma`` fixed rows, a chain under the root next to
the heads' branches (rank = the heads' tree width), unfilled (-1, never accepted) where there is
no match. Dynamic tree (:func:`follow_heads`, :func:`merge_chain`): the chain follows the heads'
nodes as long as its tokens are already there, and only its remaining tokens get new rows.
"""

from __future__ import annotations

import torch

from ..trees.buffers import TreeBuffers, compile_paths
from ..trees.draft import Draft
from .lookup import LookupDrafter

__all__ = ["LookupBranch", "follow_heads", "merge_chain"]


class LookupBranch:
    """A static tree plus a ``lookup.gamma``-token chain under its root.

    ``tree``: the combined tree; ``heads_nodes`` (N_heads - 1,) and ``branch_nodes`` (gamma,) long:
    where the heads' non-root nodes and the chain's nodes are in it."""

    def __init__(self, heads_tree: TreeBuffers, lookup: LookupDrafter):
        self.lookup = lookup
        r = int(heads_tree.children[0].ge(0).sum())
        branch = [(r,) + (0,) * d for d in range(lookup.gamma)]
        both = compile_paths(list(heads_tree.paths[1:]) + branch)
        self.heads_nodes = torch.tensor([both.paths.index(p) for p in heads_tree.paths[1:]], dtype=torch.long)
        self.branch_nodes = torch.tensor([both.paths.index(p) for p in branch], dtype=torch.long)
        self.tree = both

    def draft(self, context: torch.Tensor, root: torch.Tensor, heads_tokens: torch.Tensor) -> Draft:
        """context (L,) long, root (1,) long, heads_tokens (N_heads - 1,) long -> the combined draft."""
        tokens = torch.full((self.tree.size,), -1, dtype=torch.long)
        tokens[0] = root[0]
        tokens[self.heads_nodes] = heads_tokens
        cont, predicted = self.lookup.match(context)
        tokens[self.branch_nodes[: cont.shape[0]]] = cont
        marks = None
        if predicted:  # the chain's nodes came from the request's prediction
            marks = torch.zeros(self.tree.size, dtype=torch.bool)
            marks[self.branch_nodes[: cont.shape[0]]] = True
        return Draft(self.tree, tokens, predicted=marks)


def follow_heads(cont: list[int], paths: list[tuple[int, ...]], tokens: list[int]) -> list[int]:
    """The positions, in the heads' best-first list ``paths`` / ``tokens``, of the chain ``cont``'s
    first tokens while it runs down the heads' nodes (each the child of the one before; increasing,
    since ancestors come first in a best-first list)."""
    where = {(p[:-1], t): i for i, (p, t) in enumerate(zip(paths, tokens))}  # (parent, token) -> order
    walk: list[int] = []
    parent: tuple[int, ...] = ()
    for t in cont:
        i = where.get((parent, t))
        if i is None:
            break
        walk.append(i)
        parent = paths[i]
    return walk


def merge_chain(root: torch.Tensor, paths: list[tuple[int, ...]], tokens: list[int], m: int, cont: list[int],
                walk: list[int], c: int) -> tuple[TreeBuffers, torch.Tensor, int, torch.Tensor]:
    """The tree of the heads' first ``m`` best-first nodes plus ``c`` rows of the chain ``cont``
    that they do not hold (``walk``: :func:`follow_heads`), hung below the deepest of its tokens the
    m nodes hold. root (1,) long -> (tree, its tokens (N,) long, chain tokens the m nodes hold,
    (N,) bool: the nodes holding the chain's tokens, the heads' ones among them)."""
    matched = sum(i < m for i in walk)
    parent = paths[walk[matched - 1]] if matched else ()
    rank = sum(1 for p in paths[:m] if p[:-1] == parent)  # first free rank under the parent
    branch = [(parent + (rank,) + (0,) * d, t) for d, t in enumerate(cont[matched:matched + c])]
    by_path = dict(zip(paths[:m], tokens[:m]))
    by_path.update(branch)
    tree = compile_paths(list(by_path))
    held = {paths[i] for i in walk[:matched]} | {p for p, _ in branch}
    marks = torch.tensor([False] + [p in held for p in tree.paths[1:]], dtype=torch.bool)
    return tree, torch.tensor([int(root[0])] + [by_path[p] for p in tree.paths[1:]], dtype=torch.long), matched, marks
