"""What a grammar mask costs on this CPU, per engine: the numbers the choice of constraints.DEFAULT_ENGINE
rests on. Run it on a quiet machine (nothing else on the cores), e.g.

    python tools/grammar_mask_cost.py --out grammar-mask-cost.json

For each engine (llguidance and xgrammar through speculant's own adapters, ``grammars``;
outlines-core through the adapter below, a regular-language index: JSON Schema only, compiled to a
regex) on the real tokenizer of ``--preset`` (Qwen2.5-Coder's 151,665 tokens, logits of 151,936):

* ``setup_s``: building the engine's view of the tokenizer (once per model);
* ``compile_s``: compiling the JSON Schema below (once per schema);
* ``mask_us``: one next-token bitmask, at every position of a document valid for the schema
  (the engine's fill alone; plain decoding pays this once per token);
* ``apply_us``: that row unpacked and applied to float32 logits (``constraints.Constraint``'s part);
* ``trees``: for each tree, the whole ``Constraint.mask_tree`` of a verification pass — every
  node's row masked for its own path (advance, fill, roll back), the draft's tokens grammatical
  where they can be (the costly case) — in ms per pass and µs per node, at several positions.

Times are medians (and means) over ``--repeats`` runs. The result is one JSON document (stdout, or
``--out``). Engines that are not installed are reported as such (xgrammar: ``pip install
--no-deps xgrammar==0.2.9 apache-tvm-ffi``; outlines-core: ``pip install --no-deps
outlines-core==0.2.14``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from speculant.constraints import Constraint, unpack_bitmask  # noqa: E402
from speculant.grammars import GrammarSpec, make_engine, mask_words  # noqa: E402
from speculant.trees.buffers import TreeBuffers, build_tree, chain  # noqa: E402

# a tool call's arguments: strings, numbers, an enum, an array of objects, nesting
SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "line": {"type": "integer", "minimum": 1},
        "mode": {"enum": ["replace", "insert", "delete"]},
        "edits": {"type": "array", "items": {
            "type": "object",
            "properties": {"old": {"type": "string"}, "new": {"type": "string"}, "score": {"type": "number"}},
            "required": ["old", "new"], "additionalProperties": False}},
        "dry_run": {"type": "boolean"},
    },
    "required": ["path", "line", "mode", "edits", "dry_run"],
    "additionalProperties": False,
}
DOCUMENT = {"path": "src/speculant/decoding.py", "line": 212, "mode": "replace",
            "edits": [{"old": "logits = raw", "new": "logits = masked(raw)", "score": 0.75},
                      {"old": "return step", "new": "return step  # done"}],
            "dry_run": False}
TREES = ("chain:4", "chain:8", "chain:16", "2x2x1", "4x2x1", "4x2x2x1")


# ---- outlines-core behind speculant's Matcher protocol -----------------------------------------
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character each byte is written as in the vocabulary."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class OutlinesEngine:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        import outlines_core

        self.vocab_size = vocab_size
        self.eos = min(eos_token_ids)
        decoder, special = _byte_decoder(), set(tokenizer.all_special_ids)
        vocab: dict[bytes, list[int]] = {}
        for tok, i in tokenizer.get_vocab().items():
            if i in special or i == self.eos:
                continue
            raw = bytes(decoder[c] for c in tok) if all(c in decoder for c in tok) else tok.encode()
            vocab.setdefault(raw, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(self.eos, vocab)

    def compile(self, spec: GrammarSpec):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        if spec.kind != "json_schema":
            raise ValueError("outlines-core takes regular languages only (here: a JSON Schema)")
        index = outlines_core.Index(build_regex_from_schema(spec.source), self.vocabulary)
        return _OutlinesGrammar(index, self.eos, self.vocab_size)


class _OutlinesGrammar:
    def __init__(self, index, eos, mask_vocab):
        self.index, self.eos, self.mask_vocab = index, eos, mask_vocab

    def matcher(self):
        import outlines_core

        return _OutlinesMatcher(outlines_core.Guide(self.index, max_rollback=1 << 16), self.index, self.eos)


class _OutlinesMatcher:
    def __init__(self, guide, index, eos):
        self.g, self.index, self.eos = guide, index, eos

    def fill(self, bitmask, row):
        v = bitmask[row]
        self.g.write_mask_into(v.data_ptr(), v.numel(), v.element_size())

    def advance(self, token):
        try:
            self.g.advance(int(token), return_tokens=False)
            return True
        except ValueError:
            return False

    def rollback(self, n):
        if n:
            self.g.rollback_state(n)

    def can_end(self):
        return self.index.is_final_state(self.g.get_state())

    def ended(self):
        return self.can_end() and set(self.index.get_allowed_tokens(self.g.get_state()) or []) <= {self.eos}

    def error(self):
        return ""


# ---- measuring --------------------------------------------------------------------------------
def _stats(us: list[float]) -> dict:
    return {"median": statistics.median(us), "mean": statistics.fmean(us), "max": max(us), "n": len(us)}


def _tree(spec: str) -> TreeBuffers:
    return chain(int(spec.split(":")[1])) if spec.startswith("chain:") else build_tree(spec)


def _tree_tokens(grammar, doc: list[int], pos: int, tree: TreeBuffers, V: int, eos: list[int]) -> torch.Tensor:
    """Tokens for ``tree`` drafted at document position ``pos``: each node's first child the
    document's next token while on the document's path, the others further tokens the grammar
    allows there (so most paths are grammatical, every row a real mask)."""
    tokens = torch.full((tree.size,), -1, dtype=torch.long)
    tokens[0] = doc[pos - 1] if pos else 0
    m = grammar.matcher()
    for t in doc[:pos]:
        assert m.advance(t)
    bits = torch.zeros(1, mask_words(grammar.mask_vocab), dtype=torch.int32)
    kids = tree.children.tolist()

    def visit(i: int, on_doc: bool, depth: int) -> None:
        m.fill(bits, 0)
        allowed = [t for t in _allowed(bits, V) if t not in eos]  # an EOS child ends a path
        choices = ([doc[pos + depth]] if on_doc and pos + depth < len(doc) else []) + allowed[:8]
        for rank, c in enumerate(c for c in kids[i] if c >= 0):
            t = choices[rank % len(choices)] if choices else 0
            tokens[c] = t
            if m.advance(t):
                visit(c, on_doc and rank == 0, depth + 1)
                m.rollback(1)

    visit(0, True, 0)
    return tokens


def _allowed(bits: torch.Tensor, V: int) -> list[int]:
    return unpack_bitmask(bits, V)[0].nonzero().flatten().tolist()


def measure(engine, doc: list[int], V: int, eos: list[int], repeats: int, trees: list[str], positions: int) -> dict:
    out: dict = {}
    t = time.perf_counter()
    grammar = engine.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    out["compile_s"] = time.perf_counter() - t
    bits = torch.zeros(1, mask_words(grammar.mask_vocab), dtype=torch.int32)
    logits = torch.randn(1, V)
    fill, apply = [], []
    for _ in range(repeats):  # each state's mask filled once per walk, as decoding does (no warm repeats)
        m = grammar.matcher()
        for tok in doc:
            t = time.perf_counter_ns()
            m.fill(bits, 0)
            fill.append((time.perf_counter_ns() - t) / 1e3)
            c = Constraint(m, V, eos, grammar.mask_vocab)
            t = time.perf_counter_ns()
            c._apply(logits, bits, [0], [m.can_end()])
            apply.append((time.perf_counter_ns() - t) / 1e3)
            if not m.advance(tok):
                raise RuntimeError(f"{engine.name} refuses the document at token {tok}")
    out["mask_us"], out["apply_us"] = _stats(fill), _stats(apply)
    out["trees"] = {}
    where = sorted({int(i * (len(doc) - 1) / max(positions - 1, 1)) for i in range(positions)})
    for spec in trees:
        tree = _tree(spec)
        per_pass = []
        for pos in where:
            tokens = _tree_tokens(grammar, doc, pos, tree, V, eos)
            rows = torch.randn(tree.size, V)
            for _ in range(repeats):
                c = Constraint.start(grammar, V, eos)  # a fresh state each time: no warm repeats
                for t in doc[:pos]:
                    c.matcher.advance(t)
                t = time.perf_counter_ns()
                c.mask_tree(rows, tree, tokens)
                per_pass.append((time.perf_counter_ns() - t) / 1e6)
        s = _stats(per_pass)
        out["trees"][spec] = {"nodes": tree.size, "ms_per_pass": s,
                              "us_per_node_median": s["median"] * 1e3 / tree.size}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--engines", default="llguidance,xgrammar,outlines-core")
    ap.add_argument("--trees", default=",".join(TREES), help="chain:N or k-configs, comma-separated")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--positions", type=int, default=8, help="document positions each tree is drafted at")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the masks themselves are one thread)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoConfig, AutoTokenizer

    from speculant.store.models import resolve

    directory = resolve(args.preset, torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    V = int(AutoConfig.from_pretrained(str(directory)).get_text_config().vocab_size)
    eos = [tokenizer.eos_token_id]
    doc = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    report = {"preset": args.preset, "tokenizer_tokens": len(tokenizer), "vocab_size": V, "document_tokens": len(doc),
              "schema": SCHEMA, "repeats": args.repeats, "threads": args.threads,
              "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                          "torch": torch.__version__}, "engines": {}}
    for name in args.engines.split(","):
        entry: dict = {}
        try:
            from importlib.metadata import version

            entry["version"] = version(name)
        except Exception:  # noqa: BLE001 -- not installed
            entry["version"] = None
        try:
            t = time.perf_counter()
            engine = (OutlinesEngine(tokenizer, V, eos) if name == "outlines-core"
                      else make_engine(name, tokenizer, V, eos))
            entry["setup_s"] = time.perf_counter() - t
            entry.update(measure(engine, doc, V, eos, args.repeats, args.trees.split(","), args.positions))
        except Exception as e:  # noqa: BLE001 -- report and go on with the next engine
            entry["error"] = f"{type(e).__name__}: {e}"
        report["engines"][name] = entry
        print(f"{name}: {json.dumps(entry)[:200]}", file=sys.stderr, flush=True)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
