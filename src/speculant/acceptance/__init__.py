"""Acceptance: which drafted tokens the target keeps.

exact    the lossless rules (greedy matching, speculative sampling, multi-candidate speculative
         sampling with and without replacement): pure tensor functions, no model in sight.
approx   approximate rules (Medusa typical acceptance, BPD top-k / distance / minimum block); NOT
         lossless, off by default.
walk     the tree walk: the target's logits at every node of a drafted tree -> the accepted path
         and the target's next token (bonus or recovered), with either kind of rule.
"""

from .approx import (accepted_prefix, best_path, distance_accept, entropy, min_block, topk_accept, typical_accept,
                     typical_threshold)
from .exact import greedy_accept, mcss, residual_distribution, speculative_sampling
from .walk import accept_tree, accept_tree_approx

__all__ = ["accept_tree", "accept_tree_approx", "accepted_prefix", "best_path", "distance_accept", "entropy",
           "greedy_accept", "mcss", "min_block", "residual_distribution", "speculative_sampling", "topk_accept",
           "typical_accept", "typical_threshold"]
