"""Constrained decoding (response_format) under speculation, on the real SmolLM2 tokenizer with a tiny
random model of its vocabulary: every verified node's row is the row a one-token step gives once
its path is committed (bit for bit), every output matches its format, greedy constrained
speculation equals plain constrained decoding (and the constraint changes the output), and
sampled constrained output follows the masked target distribution (with a negative control)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil

import jsonschema
import pytest
import torch
from scipy.stats import chisquare

from speculant import ConfigError, SpeculativeDecoder
from speculant.backends.hf import HFBackend
from speculant.config import SamplingConfig
from speculant.constraints import Constraint, GrammarError, parse_response_format, unpack_bitmask
from speculant.decoding import decode
from speculant.drafters.base import NoDrafter
from speculant.drafters.draft_model import DraftModelDrafter
from speculant.drafters.lookup import LookupDrafter
from speculant.drafters.medusa import MedusaDrafter
from speculant.errors import ModelLoadError
from speculant.grammars import GrammarSpec, make_engine, mask_words
from speculant.heads import HeadsConfig, MedusaHeads
from speculant.penalties import Penalties
from speculant.store import models
from speculant.trees.buffers import build_tree, chain

from tiny import perturbed, tiny_llama

PRESET = "smollm2-135m-instruct"
V, H, EOS = 49152, 64, 2
_CACHE = os.environ.get("SPECULANT_CACHE")  # the real cache, before the tests' private one is set

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99},
                                           "tag": {"enum": ["red", "green"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}  # no runs of whitespace from a random model
FORMATS = {
    "json_object": {"type": "json_object"},
    "json_schema": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
    "regex": {"type": "regex", "regex": r"(cat|dog)s? [0-9]{1,3}"},
    "lark": {"type": "grammar", "grammar": 'start: "(" item ("," item)* ")"\nitem: "x" | "yy" | /[0-9]{1,2}/'},
    "gbnf": {"type": "grammar", "grammar": 'root ::= "<" [a-c]+ ">"'},
}


@contextlib.contextmanager
def _real_cache():
    old = os.environ.get("SPECULANT_CACHE")
    if _CACHE is None:
        os.environ.pop("SPECULANT_CACHE", None)
    else:
        os.environ["SPECULANT_CACHE"] = _CACHE
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SPECULANT_CACHE", None)
        else:
            os.environ["SPECULANT_CACHE"] = old


@pytest.fixture(scope="module")
def model_dir():
    """The converted SmolLM2 directory (its tokenizer; its weights are not used)."""
    try:
        with _real_cache():
            return models.resolve(PRESET, torch.float32)
    except ModelLoadError as e:
        pytest.skip(f"the {PRESET} preset is not installed (make install): {e}")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_engine("llguidance", tokenizer, V, [EOS])


@pytest.fixture(scope="module")
def grammars(engine):
    return {name: engine.compile(parse_response_format(rf)) for name, rf in FORMATS.items()}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, vocab=V, hidden=H, scale=4.0)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed(target, noise=0.3, seed=1)


@pytest.fixture(scope="module")
def heads():
    torch.manual_seed(0)
    heads = MedusaHeads(HeadsConfig(3, 1, H, V, shared_lm_head=False))
    with torch.no_grad():
        for p in heads.parameters():
            p.mul_(4.0)
    return heads.eval()


def _prompts(tokenizer) -> list[torch.Tensor]:
    texts = ['Answer in JSON: {"ok":true,"n":7,"tag":"red"} and {"ok":', "cats 12, dogs 3, cat 45, dog",
             "(x,yy,12) <abc> <", "Hi"]
    return [torch.tensor(tokenizer.encode(t)) for t in texts]


def _decode(target, drafter, prompt, grammar=None, sampling=SamplingConfig(), n=48, seed=0):
    constraint = None if grammar is None else Constraint.start(grammar, V, {EOS})
    d = drafter(constraint) if callable(drafter) else drafter
    gen = torch.Generator().manual_seed(seed)
    state = None
    for state, _ in decode(HFBackend(target), d, prompt, max_new_tokens=n, sampling=sampling, eos_token_ids={EOS},
                           generator=gen, constraint=constraint):
        pass
    return state


def _drafters(draft, heads, sampling=SamplingConfig()):
    return {
        "lookup": lambda c: LookupDrafter(4),
        "sd chain": lambda c: DraftModelDrafter(HFBackend(draft), chain(4), sampling, V, constraint=c),
        "mcsd 2x2x1": lambda c: DraftModelDrafter(HFBackend(draft), build_tree("2x2x1"), sampling, V, constraint=c),
        "sd unmasked draft": lambda c: DraftModelDrafter(HFBackend(draft), build_tree("2x2x1"), sampling, V),
        "medusa": lambda c: MedusaDrafter(heads, build_tree("3x2x1"), V),
    }


# ---- response_format shapes -------------------------------------------------------------------
def test_response_format_shapes():
    assert parse_response_format(None) is None and parse_response_format({"type": "text"}) is None
    assert parse_response_format({"type": "json_object"}) == GrammarSpec("json_object")
    spec = parse_response_format(FORMATS["json_schema"])
    assert spec.kind == "json_schema" and spec.strict and json.loads(spec.source) == SCHEMA
    lenient = parse_response_format({"type": "json_schema", "json_schema": {"name": "a", "schema": {}}})
    assert not lenient.strict  # OpenAI's default: not strict
    assert parse_response_format({"type": "regex", "regex": "a+"}) == GrammarSpec("regex", "a+")
    bad = {
        "must be an object": ["json_object"],
        "type must be one of": {"type": "xml"},
        "got no \"type\"": {"regex": "a"},
        "unknown key": {"type": "json_object", "schema": {}},
        "needs \"json_schema\"": {"type": "json_schema"},
        "needs a \"name\"": {"type": "json_schema", "json_schema": {"schema": {}}},
        "needs a \"schema\"": {"type": "json_schema", "json_schema": {"name": "a"}},
        "strict\" must be": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}},
        "takes name, schema": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "extra": 1}},
        "not JSON": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"x": float("nan")}}},
        "non-empty string 'regex'": {"type": "regex", "regex": ""},
        "non-empty string 'grammar'": {"type": "grammar", "grammar": 5},
    }
    for message, rf in bad.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_response_format(rf)


def test_bad_grammars_are_refused(engine):
    for spec, message in ((GrammarSpec("regex", "(("), "unclosed group"),
                          (GrammarSpec("grammar", "start: @@@"), "lexer error"),
                          (GrammarSpec("json_schema", '{"type": "objectx"}'), "objectx")):
        with pytest.raises(ConfigError, match=message):
            engine.compile(spec)
    unknown = json.dumps({"type": "object", "properties": {"a": {"type": "string", "format": "weird"}}})
    with pytest.raises(ConfigError, match="Unknown format"):
        engine.compile(GrammarSpec("json_schema", unknown, strict=True))
    engine.compile(GrammarSpec("json_schema", unknown, strict=False))  # not strict: the keyword is ignored


# ---- the rows -----------------------------------------------------------------------------------
def _row_after(grammar, committed: list[int], logits_row: torch.Tensor) -> torch.Tensor:
    """The masked row a one-token step gives after ``committed`` tokens (written out)."""
    m = grammar.matcher()
    for t in committed:
        assert m.advance(t)
    bits = torch.zeros(1, mask_words(V), dtype=torch.int32)
    m.fill(bits, 0)
    allowed = unpack_bitmask(bits, V)[0]
    allowed[EOS] = m.can_end()
    return logits_row.float().masked_fill(~allowed, float("-inf"))


def test_each_nodes_row_is_masked_for_its_own_path(grammars, tokenizer):
    _check_rows(grammars["regex"], tokenizer)


def _check_rows(grammar, tokenizer) -> None:
    """Every row of a tree pass under the regex grammar (cat|dog)s? [0-9]{1,3} against a one-token step."""
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in ("cat", "dog", "s", "Ġ", "1", "2", "x")}
    tree = build_tree("3x2x2")
    tokens = torch.full((tree.size,), ids["x"])
    levels = [[], [ids["cat"], ids["dog"], ids["x"]], [ids["s"], ids["Ġ"]], [ids["Ġ"], ids["1"]]]
    for d in range(1, 4):
        for j, node in enumerate(tree.levels[d].tolist()):
            tokens[node] = levels[d][j % len(levels[d])]
    committed = []  # the grammar's start; the root is the prompt's last token
    logits = torch.randn(tree.size, V, generator=torch.Generator().manual_seed(0))
    constraint = Constraint.start(grammar, V, {EOS})
    got = constraint.mask_tree(logits, tree, tokens)
    refused = 0
    for i in range(tree.size):
        path, j = [], i
        while j > 0:
            path.append(int(tokens[j]))
            j = int(tree.parents[j])
        path = path[::-1]
        m = grammar.matcher()
        if all(m.advance(t) for t in committed + path):
            assert torch.equal(got[i], _row_after(grammar, committed + path, logits[i])), i
            # bit for bit what a one-token step computes once that path is committed
            alone = Constraint.start(grammar, V, {EOS})
            for t in path:
                alone.matcher.advance(t)
            assert torch.equal(alone.mask_tree(logits[i:i + 1], chain(0), tokens[i:i + 1])[0], got[i])
        else:  # a path the grammar refuses: never accepted, its row left as it was
            refused += 1
            assert torch.equal(got[i], logits[i])
    assert 0 < refused < tree.size - 1
    # the committed state did not move; the draft-side masks are the same rows
    assert torch.equal(constraint.mask_tree(logits[:1], chain(0), tokens[:1])[0], got[0])
    nodes = tree.levels[2]
    assert torch.equal(constraint.mask_nodes(logits[nodes], tree, tokens, nodes), got[nodes])


def test_eos_only_where_the_grammar_may_end_and_the_end_ends_it(grammars, tokenizer):
    g = grammars["regex"]
    c = Constraint.start(g, V, {EOS})
    cat, s, sp, one, two = (tokenizer.convert_tokens_to_ids(t) for t in ("cat", "s", "Ġ", "1", "2"))
    row = lambda: c.mask_tree(torch.zeros(1, V), chain(0), torch.tensor([0]))[0]  # noqa: E731
    assert row()[EOS] == float("-inf")
    assert c.commit([cat, sp, one], None) == ([cat, sp, one], None)
    assert row()[EOS] == 0 and row()[two] == 0  # "cat 1" may end, or go on
    assert c.commit([two, two, EOS], "eos") == ([two, two], "stop")  # "cat 122": nothing more; the rest is cut
    assert c.ended
    c = Constraint.start(g, V, {EOS})
    assert c.commit([cat, s, sp, one, EOS], "eos") == ([cat, s, sp, one, EOS], "eos")  # the model ended it
    with pytest.raises(GrammarError, match="not allowed"):
        Constraint.start(g, V, {EOS}).commit([s], None)


def test_a_draft_is_cut_before_its_first_refused_node(grammars, tokenizer):
    g = grammars["regex"]  # (cat|dog)s? [0-9]{1,3}
    cat, s, sp, one, dog = (tokenizer.convert_tokens_to_ids(t) for t in ("cat", "s", "Ġ", "1", "dog"))
    c = Constraint.start(g, V, {EOS})
    assert c.allowed_prefix(chain(5), torch.tensor([0, cat, s, sp, one, one])) == 6  # all allowed
    assert c.allowed_prefix(chain(5), torch.tensor([0, cat, s, s, one, one])) == 3  # "cats" then "s": cut at it
    assert c.allowed_prefix(chain(2), torch.tensor([0, one, cat])) == 1  # nothing but the root
    tree = build_tree([[0], [1], [0, 0], [1, 0]])  # nodes: cat, dog, cat>s, dog>1 (refused)
    assert c.allowed_prefix(tree, torch.tensor([0, cat, dog, s, one])) == 4
    assert c.allowed_prefix(tree, torch.tensor([0, one, dog, s, s])) == 1  # node 1 refused: the rest cut too
    assert c.commit([cat], None) == ([cat], None)  # the committed state was left as it was


def test_constrained_lookup_verifies_fewer_rows_and_writes_the_same(grammars, target, tokenizer, monkeypatch):
    # prompt lookup proposes the prompt's continuations (", dogs 3, ..." after a match), which the
    # grammar refuses: cut before verification, they cost no rows, and the output is unchanged
    prompt = torch.tensor(tokenizer.encode("cats 12, dogs 3, cat 45, dog 7, cats 12, dogs 3, cat"))
    plain = _decode(target, NoDrafter(), prompt, grammars["regex"])
    cut = _decode(target, LookupDrafter(6), prompt, grammars["regex"])
    monkeypatch.setattr(Constraint, "allowed_prefix", lambda self, tree, tokens: tree.size)  # no cut
    whole = _decode(target, LookupDrafter(6), prompt, grammars["regex"])
    assert cut.context.tolist() == whole.context.tolist() == plain.context.tolist()
    assert sum(cut.stats.drafted_per_call) < sum(whole.stats.drafted_per_call)


# ---- outputs ------------------------------------------------------------------------------------
def _check_output(name: str, grammar, tokens: list[int], finish: str, tokenizer) -> bool:
    """Whether the output is complete (and then valid); a cut one must be a valid prefix."""
    body = tokens[:-1] if tokens and tokens[-1] == EOS else tokens
    m = grammar.matcher()
    assert all(m.advance(t) for t in body), (name, tokenizer.decode(body))
    if finish == "length":
        return False
    assert finish in ("stop", "eos") and m.can_end()
    text = tokenizer.decode(body)
    if name == "json_object":
        assert isinstance(json.loads(text), dict)
    elif name == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif name == "regex":
        assert re.fullmatch(FORMATS["regex"]["regex"], text), text
    elif name == "lark":
        assert re.fullmatch(r"\((x|yy|[0-9]{1,2})(,(x|yy|[0-9]{1,2}))*\)", text), text
    else:
        assert re.fullmatch(r"<[a-c]+>", text), text
    return True


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_sampled_output_matches_its_format(name, grammars, target, draft, heads, tokenizer):
    complete = 0
    sampling = SamplingConfig(temperature=1.0, top_k=50)
    for seed, prompt in enumerate(_prompts(tokenizer)[:3]):
        for make in (NoDrafter(), *_drafters(draft, heads, sampling).values()):
            state = _decode(target, make, prompt, grammars[name], sampling, n=24, seed=seed)
            complete += _check_output(name, grammars[name], state.generated, state.finish_reason, tokenizer)
    assert complete > 0


@pytest.mark.parametrize("name", list(FORMATS))
def test_greedy_constrained_speculation_is_plain_constrained_decoding(name, grammars, target, draft, heads, tokenizer):
    changed = accepted = 0
    for prompt in _prompts(tokenizer):
        plain = _decode(target, NoDrafter(), prompt, grammars[name], n=32)
        _check_output(name, grammars[name], plain.generated, plain.finish_reason, tokenizer)
        changed += plain.generated != _decode(target, NoDrafter(), prompt, n=32).generated
        for label, make in _drafters(draft, heads).items():
            state = _decode(target, make, prompt, grammars[name], n=32)
            assert state.generated == plain.generated, (label, prompt)
            assert state.finish_reason == plain.finish_reason
            accepted += sum(state.stats.accepted_per_call)
    assert changed == len(_prompts(tokenizer))  # the grammar changes every output: the equality says something
    assert accepted > 0


def test_a_masked_draft_is_accepted_more(grammars, target, draft, tokenizer):
    prompt = _prompts(tokenizer)[0]
    runs = [_decode(target, lambda c, m=m: DraftModelDrafter(HFBackend(draft), chain(4), SamplingConfig(), V,
                                                             constraint=c if m else None),
                    prompt, grammars["json_schema"]) for m in (True, False)]
    assert runs[0].generated == runs[1].generated
    assert runs[0].stats.acceptance_rate > runs[1].stats.acceptance_rate


def test_penalties_and_constraint_together(grammars, target, draft, tokenizer):
    sampling = SamplingConfig(penalties=Penalties(presence=1.0, frequency=0.5, repetition=1.3))
    for prompt in _prompts(tokenizer)[:2]:
        plain = _decode(target, NoDrafter(), prompt, grammars["lark"], sampling)
        spec = _decode(target, DraftModelDrafter(HFBackend(draft), build_tree("2x2x1"), sampling, V),
                       prompt, grammars["lark"], sampling)
        assert spec.generated == plain.generated


def test_xgrammar_behind_the_same_protocol(tokenizer, target, draft, heads):
    """The alternative engine (not a dependency: installed by hand) passes the same checks."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("tvm_ffi")
    engine = make_engine("xgrammar", tokenizer, V, [EOS])
    _check_rows(engine.compile(parse_response_format(FORMATS["regex"])), tokenizer)
    for name in ("regex", "gbnf"):
        grammar = engine.compile(parse_response_format(FORMATS[name]))
        for prompt in _prompts(tokenizer)[1:3]:
            plain = _decode(target, NoDrafter(), prompt, grammar, n=24)
            _check_output(name, grammar, plain.generated, plain.finish_reason, tokenizer)
            for label in ("lookup", "mcsd 2x2x1", "medusa"):
                state = _decode(target, _drafters(draft, heads)[label], prompt, grammar, n=24)
                assert state.generated == plain.generated, (name, label)


# ---- the public API -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory, model_dir, target):
    path = tmp_path_factory.mktemp("constrained") / "target"
    target.generation_config.eos_token_id = EOS
    target.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, path / name)
    return str(path)


def test_api_response_format(decoder_dir):
    plain = SpeculativeDecoder(decoder_dir, method="ar", dtype="float32")
    lookup = SpeculativeDecoder(decoder_dir, method="lookup", dtype="float32", pacing=False)
    prompt = 'Answer in JSON: {"ok":true,"n":7,"tag":"red"} and {"ok":'
    rf = FORMATS["json_schema"]
    want = plain.generate(prompt, 40, response_format=rf)
    assert want.finish_reason in ("stop", "eos")
    jsonschema.validate(json.loads(want.text), SCHEMA)
    assert lookup.generate(prompt, 40, response_format=rf).token_ids == want.token_ids
    assert "".join(e.text for e in lookup.stream(prompt, 40, response_format=rf)) == want.text
    batch = lookup.generate([prompt, "cats 12"], 40, response_format=rf)  # the batch driver (join)
    assert batch[0].token_ids == want.token_ids
    jsonschema.validate(json.loads(batch[1].text), SCHEMA)
    free = plain.generate(prompt, 40, response_format={"type": "text"})
    assert free.token_ids == plain.generate(prompt, 40).token_ids != want.token_ids
    with pytest.raises(ConfigError, match="type must be one of"):
        plain.start(prompt, response_format={"type": "yaml"})
    with pytest.raises(ConfigError, match="unclosed group"):
        plain.start(prompt, response_format={"type": "regex", "regex": "(("})
    typical = SpeculativeDecoder(decoder_dir, method="lookup", dtype="float32", acceptance="typical")
    with pytest.raises(ConfigError, match="exact acceptance rule"):
        typical.start(prompt, response_format=rf)


# ---- sampling: the masked target distribution ---------------------------------------------------
N_SAMPLES = 3000
REGEX = "[abc]{2}"


def _outcome(grammar, tokens: list[int]) -> tuple[int, ...] | None:
    """The tokens up to where the grammar ends; None if it refuses one before."""
    m = grammar.matcher()
    for i, t in enumerate(tokens):
        if m.ended():
            return tuple(tokens[:i])
        if not m.advance(t):
            return None
    return tuple(tokens) if m.ended() else None


def _masked_joint(model, grammar, prompt) -> dict[tuple[int, ...], float]:
    """Exact P(output) under the masked target, each step's row renormalised over what the grammar allows."""
    def row(seq, m):
        with torch.no_grad():
            logits = model(seq.view(1, -1)).logits[0, -1]
        bits = torch.zeros(1, mask_words(V), dtype=torch.int32)
        m.fill(bits, 0)
        return logits.masked_fill(~unpack_bitmask(bits, V)[0], float("-inf")).softmax(-1)

    out = {}
    m = grammar.matcher()
    p1 = row(prompt, m)
    for x1 in p1.nonzero().flatten().tolist():
        assert m.advance(x1)
        if m.ended():
            out[(x1,)] = float(p1[x1])
        else:
            p2 = row(torch.cat([prompt, torch.tensor([x1])]), m)
            for x2 in p2.nonzero().flatten().tolist():
                out[(x1, x2)] = float(p1[x1] * p2[x2])
        m.rollback(1)
    return out


def _counts(target, grammar, make_drafter, sampling, prompt, masked=True, until_outside: dict | None = None) -> dict:
    """Outcome counts of N_SAMPLES constrained generations; with ``until_outside`` (a distribution),
    it stops at the first outcome that distribution never gives (the test's verdict is then made)."""
    gen = torch.Generator().manual_seed(99)
    backend = HFBackend(target)
    counts: dict = {}
    for _ in range(N_SAMPLES):
        if until_outside is not None and any(k not in until_outside for k in counts):
            break
        c = Constraint.start(grammar, V, {EOS})
        state = None
        for state, _ in decode(backend, make_drafter(gen, c), prompt, max_new_tokens=2, sampling=sampling,
                               generator=gen, eos_token_ids={EOS}, constraint=c if masked else None):
            pass
        key = _outcome(grammar, state.generated)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _pvalue(counts: dict, p: dict) -> float:
    keys = list(p)
    expected = torch.tensor([p[k] for k in keys]) * sum(counts.values())
    observed = torch.tensor([float(counts.get(k, 0)) for k in keys])
    lost = sum(v for k, v in counts.items() if k not in p)  # outcomes the masked target never gives
    if lost:
        return 0.0
    return chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue


@pytest.fixture(scope="module")
def sampling_case(engine, tokenizer):
    """Made once per test process and module: the tiny target and draft, the grammar, the prompt, the exact masked distribution p, and the
    sampling: every token the grammar may start with gets the same large bias, so the masked
    distribution is unchanged and the unmasked target (the negative control) samples almost only
    among them too."""
    target = tiny_llama(seed=4, vocab=V, hidden=16, layers=1, scale=10.0)
    draft = perturbed(target, noise=1.0, seed=5)
    grammar = engine.compile(GrammarSpec("regex", REGEX))
    prompt = torch.tensor(tokenizer.encode("ab c a bc ab"))
    p = _masked_joint(target, grammar, prompt)
    assert 8 <= len(p) <= 30 and max(p.values()) < 0.5  # a spread-out distribution over a few outcomes
    allowed = sorted({k[0] for k in p})
    sampling = SamplingConfig(temperature=1.0, penalties=Penalties(logit_bias=tuple((t, 20.0) for t in allowed)))
    return target, draft, grammar, prompt, p, sampling


# each case a test of its own: two test processes share them out
SAMPLED_DRAFTERS = {
    "draft-tree-masked": lambda draft, sampling: lambda g, c: DraftModelDrafter(
        HFBackend(draft), build_tree("3x2"), sampling, V, generator=g, constraint=c),
    "draft-chain": lambda draft, sampling: lambda g, c: DraftModelDrafter(HFBackend(draft), chain(2), sampling, V,
                                                                          generator=g),
    "lookup": lambda draft, sampling: lambda g, c: LookupDrafter(2),
}


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.parametrize("name", list(SAMPLED_DRAFTERS) + ["negative-control"])
def test_sampling_follows_the_masked_target(sampling_case, name):
    target, draft, grammar, prompt, p, sampling = sampling_case
    if name != "negative-control":
        assert _pvalue(_counts(target, grammar, SAMPLED_DRAFTERS[name](draft, sampling), sampling, prompt), p) > 1e-4
        return
    # the same masked drafts verified against the unmasked target
    wrong = _counts(target, grammar, SAMPLED_DRAFTERS["draft-tree-masked"](draft, sampling), sampling, prompt,
                    masked=False, until_outside=p)
    assert _pvalue(wrong, p) < 1e-4
