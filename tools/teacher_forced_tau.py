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
    python tools/teacher_forced_tau.py eval dev.jsonl --configs 7:8,auto:8     # fixed 16 rows vs sized

A config is ``NODES:N``: the dynamic tree's heads' nodes (hydra; ignored by medusa's static tree;
every other setting, e.g. the depth, is hydra's default tree's) and the lookup chain's length N (0: no
chain); ``auto:N`` sizes every step's tree against this machine's measured pass cost (the decoder's
default, ``tree_budget="auto"``, up to ``api.DEFAULT_MAX_ROWS`` rows).

Each config also reports a simulated speed-up over plain decoding on the same text,
``cost(1) x tokens / sum over steps of (cost(rows) + drafting ms)``, from the machine's measured
pass-cost curve (``costmodel.pass_cost``) and the drafting time measured in the replay. It leaves
out the prefill, which both pay alike, so a real bench's ratio is lower.
"""
import argparse
import dataclasses
import json
import time

import torch

from speculant import SpeculativeDecoder, tune_allocator
from speculant.api import DEFAULT_HYDRA_TREE, DEFAULT_MAX_ROWS
from speculant.backends.base import HiddenNeed
from speculant.tuning.sizing import TreeSizer
from speculant.specbench import load_questions
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


def replay(drafter: MedusaDrafter, ids: torch.Tensor, prompt_len: int, hidden: torch.Tensor,
           cost=None) -> tuple[int, int, float]:
    """(answer tokens, steps, simulated ms) of the decode loop on the fixed ``ids``; hidden[j] is
    the target's state at position prompt_len - 1 + j. Simulated ms: cost(rows) + the drafting
    time of every step (0 without a cost curve)."""
    n, i = ids.shape[0], prompt_len - 1  # the prefill step produced ids[prompt_len]: one step, one token
    tokens, steps, ms = 1, 1, cost(1) if cost else 0.0
    while i + 1 < n:  # root = ids[i + 1], the token the state at i produced
        drafter.hidden = hidden[i - (prompt_len - 1)]
        t = time.perf_counter()
        draft = drafter.propose(ids[: i + 2])
        draft_ms = (time.perf_counter() - t) * 1e3
        toks, parents, depths = draft.tokens.tolist(), draft.tree.parents.tolist(), draft.tree.depths.tolist()
        ok, accepted, last = [True] + [False] * (len(toks) - 1), 0, 0
        for k in range(1, len(toks)):  # parents come before children
            pos = i + 1 + depths[k]
            ok[k] = ok[parents[k]] and pos < n and toks[k] == int(ids[pos])
            if ok[k] and depths[k] > accepted:
                accepted, last = depths[k], k
        if drafter.sizer is not None:
            path = [last]
            while path[-1] != 0:
                path.append(parents[path[-1]])
            drafter.sizer.observe(path[::-1])
        if cost:
            ms += cost(len(toks)) + draft_ms
        tokens, steps, i = tokens + 1 + accepted, steps + 1, i + 1 + accepted
    return min(tokens, n - prompt_len), steps, ms


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
            states.append(be.forward(ids, rows=torch.arange(P - 1, len(ids)), want_hidden=HiddenNeed.LAST).hidden)
    be.reset()
    cost = dec.sizer.cost if dec.sizer is not None else None
    if cost:
        print("pass cost (ms by rows):", dict(zip(cost.rows, (round(m) for m in cost.ms))), flush=True)
    for cfg in args.configs.split(","):
        nodes, chain = cfg.split(":")
        chain = int(chain)
        sized = nodes == "auto"
        nodes = max(DEFAULT_MAX_ROWS - 1 - chain, 4) if sized else int(nodes)
        sizer = TreeSizer(cost, max_rows=DEFAULT_MAX_ROWS) if sized else None  # shared, as a decoder shares it
        t0, per_cat = time.time(), {}
        with torch.inference_mode():
            for r, h in zip(recs, states):
                lookup = LookupDrafter(chain) if chain else None
                dynamic = default_tree(nodes) if args.method == "hydra" else None
                drafter = MedusaDrafter(dec.heads, dec.tree, dec.vocab_size, lookup, dynamic=dynamic, sizer=sizer)
                got = replay(drafter, torch.tensor(r["ids"]), r["prompt_len"], h, cost)
                acc = per_cat.setdefault(r["cat"], [0, 0, 0.0])
                acc[0], acc[1], acc[2] = acc[0] + got[0], acc[1] + got[1], acc[2] + got[2]
        tok, steps = sum(a[0] for a in per_cat.values()), sum(a[1] for a in per_cat.values())
        sim = f", simulated {cost(1) * tok / sum(a[2] for a in per_cat.values()):.3f}x" if cost else ""
        print(f"{args.method} {cfg}: tau {tok / steps:.3f}{sim} | "
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
