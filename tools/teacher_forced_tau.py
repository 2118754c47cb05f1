"""Teacher-forced tokens per target call (τ) of hydra / medusa drafting on fixed target text.

Run-to-run τ of a real decode moves by a few hundredths on a dozen prompts: in bf16 a change
anywhere (another attention kernel, a wider tree) can flip a near-tie, and the text changes from
there on. This measures drafters on one fixed text instead, so two settings are compared on exactly
the same tokens:

1. ``gen``: the target's own greedy answers (bf16, chat template) to Spec-Bench questions the bench
   does not use (by default questions 3-6 of each of the 13 categories; the bench takes the first
   two of each group), saved as JSONL (prompt ids + answer ids).
2. ``eval``: one prefill pass over each prompt + answer gives the target's hidden states; then the
   decode loop is replayed: at each step the drafter proposes its tree from the hidden state of the
   last accepted token, the longest path that matches the fixed answer is accepted, and the loop
   moves on. τ = answer tokens / steps, as ``speculant bench`` counts it.

    python tools/teacher_forced_tau.py gen dev.jsonl --questions 2,3,4,5 --max-new-tokens 96
    python tools/teacher_forced_tau.py eval dev.jsonl --configs 24:4,16:12 [--method medusa] [--heads DIR]

A config is ``NODES:N``: the dynamic tree's heads' nodes (hydra; ignored by medusa's static tree;
every other setting, e.g. the depth, is hydra's default tree's) and the lookup chain's length N (0: no
chain).
"""
import argparse
import dataclasses
import json
import time

import torch

from speculant import SpeculativeDecoder, tune_allocator
from speculant.api import DEFAULT_HYDRA_TREE
from speculant.bench.harness import load_questions
from speculant.drafters.lookup import LookupDrafter
from speculant.drafters.medusa import DynamicTree, MedusaDrafter

TARGET = "qwen2.5-coder-1.5b-instruct"


def generate(args) -> None:
    dec = SpeculativeDecoder(TARGET, method="hydra", chat=True, lookup_branch=12)  # lossless: the target's text
    by_cat: dict[str, list[dict]] = {}
    for q in load_questions():
        by_cat.setdefault(q["category"], []).append(q)
    with open(args.out, "w") as f:
        for cat, qs in by_cat.items():
            for i in map(int, args.questions.split(",")):
                q = qs[i]
                ids = dec.encode(q["turns"][0])
                res = dec.generate(q["turns"][0], args.max_new_tokens)
                f.write(json.dumps({"cat": cat, "qid": q["question_id"], "prompt_len": len(ids),
                                    "ids": ids.tolist() + res.token_ids}) + "\n")
                print(cat, q["question_id"], len(res.token_ids), flush=True)


def replay(drafter: MedusaDrafter, ids: torch.Tensor, prompt_len: int, hidden: torch.Tensor) -> tuple[int, int]:
    """(answer tokens, steps) of the decode loop on the fixed ``ids``; hidden[j] is the target's
    state at position prompt_len - 1 + j."""
    n, i = ids.shape[0], prompt_len - 1  # the prefill step produced ids[prompt_len]: one step, one token
    tokens, steps = 1, 1
    while i + 1 < n:  # root = ids[i + 1], the token the state at i produced
        drafter.hidden = hidden[i - (prompt_len - 1)]
        draft = drafter.propose(ids[: i + 2])
        toks, parents, depths = draft.tokens.tolist(), draft.tree.parents.tolist(), draft.tree.depths.tolist()
        ok, accepted = [True] + [False] * (len(toks) - 1), 0
        for k in range(1, len(toks)):  # parents come before children
            pos = i + 1 + depths[k]
            ok[k] = ok[parents[k]] and pos < n and toks[k] == int(ids[pos])
            if ok[k]:
                accepted = max(accepted, depths[k])
        tokens, steps, i = tokens + 1 + accepted, steps + 1, i + 1 + accepted
    return min(tokens, n - prompt_len), steps


def default_tree(nodes: int) -> DynamicTree:
    """hydra's default dynamic tree (as ``SpeculativeDecoder`` builds it) with ``nodes`` heads' nodes."""
    return dataclasses.replace(DynamicTree.parse(DEFAULT_HYDRA_TREE), nodes=nodes)


def evaluate(args) -> None:
    dec = SpeculativeDecoder(TARGET, method=args.method, chat=True, heads=args.heads)
    recs = [json.loads(line) for line in open(args.data)]
    be, states = dec.target_backend, []
    with torch.inference_mode():
        for r in recs:
            be.reset()
            ids, P = torch.tensor(r["ids"]), r["prompt_len"]
            states.append(be.forward(ids, rows=torch.arange(P - 1, len(ids)), want_hidden=True).hidden)
    be.reset()
    for cfg in args.configs.split(","):
        nodes, chain = map(int, cfg.split(":"))
        t0, per_cat = time.time(), {}
        with torch.inference_mode():
            for r, h in zip(recs, states):
                lookup = LookupDrafter(chain) if chain else None
                dynamic = default_tree(nodes) if args.method == "hydra" else None
                drafter = MedusaDrafter(dec.heads, dec.tree, dec.vocab_size, lookup, dynamic=dynamic)
                got = replay(drafter, torch.tensor(r["ids"]), r["prompt_len"], h)
                acc = per_cat.setdefault(r["cat"], [0, 0])
                acc[0], acc[1] = acc[0] + got[0], acc[1] + got[1]
        tok, steps = sum(a[0] for a in per_cat.values()), sum(a[1] for a in per_cat.values())
        print(f"{args.method} {cfg}: tau {tok / steps:.3f} | "
              + " ".join(f"{c[:6]} {a[0] / a[1]:.2f}" for c, a in per_cat.items()) + f" ({time.time() - t0:.0f} s)",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen")
    g.add_argument("out")
    g.add_argument("--questions", default="2,3,4,5", help="indices within each category (0, 1: the bench's)")
    g.add_argument("--max-new-tokens", type=int, default=96)
    e = sub.add_parser("eval")
    e.add_argument("data")
    e.add_argument("--configs", default="24:4,16:12")
    e.add_argument("--method", choices=["hydra", "medusa"], default="hydra")
    e.add_argument("--heads", default=None, help="heads directory (default: the shipped ones)")
    args = ap.parse_args()
    tune_allocator()
    generate(args) if args.cmd == "gen" else evaluate(args)


if __name__ == "__main__":
    main()
