"""The bench's rows: speculant's own methods, the peer rows (other runtimes), and the method spec.

A row of ``speculant bench --methods`` is a method spec::

    NAME[:RULE][@OPTION]...

- ``NAME``: one of :data:`OURS` or :data:`PEERS`;
- ``RULE``: an approximate acceptance rule for speculant's own methods
  (``config.parse_acceptance``), e.g. ``medusa:typical``, ``bpd:topk=2+min=1``;
- ``@OPTION``: ``@KEY=VALUE`` settings of this row alone, which override the bench-wide flags
  (:data:`OPTIONS` says which method takes which key); ``@auto`` and ``@fixed`` are short for
  ``@budget=auto`` and ``@budget=fixed``.

So two rows of one method with different settings run side by side in one process, e.g.
``hydra+lookup@heads=A,hydra+lookup@heads=B`` (two sets of heads), ``hydra+lookup,hydra+lookup@fixed``
(the tree sized per step against the fixed 16-row tree), ``medusa+lookup@tree=dynamic:23:4``,
``hydra+lookup@lookup=12@tree=dynamic:16:3``. A value cannot contain ``,`` or ``@``; a tree made
of explicit paths goes in a JSON file (``@tree=paths.json``). ``@quant=gguf`` (or ``int4``, ``int8``, ``none``)
runs a row on another quantization of the target than ``--target-quant``'s, e.g.
``ar,auto,ar@quant=gguf,auto@quant=gguf``: such a row's output is compared with ``ar@quant=...``'s.
``@format=json`` (JSON mode) or ``@format=SCHEMA.json`` (a JSON schema, strict) makes a row's output match
that format, compared with ``ar@format=...``'s: the grammar's cost under speculation beside the same method free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..api import TREE_BUDGETS
from ..config import parse_acceptance
from ..errors import ConfigError

OURS = ("ar", "auto", "sd", "mcsd", "lookup", "medusa", "medusa+lookup", "hydra", "hydra+lookup", "eagle",
        "eagle+lookup", "bpd")
LLAMA_SERVER = {"llama-server": "plain", "llama-server+draft": "draft", "llama-server+ngram": "ngram",
                "llama-server+ngram-mod": "ngram-mod", "llama-server+ngram-map-k": "ngram-map-k"}
OPENVINO = {"openvino": "plain", "openvino+lookup": "lookup", "openvino+draft": "draft"}
PEERS = ("hf-assisted", *LLAMA_SERVER, *OPENVINO)

ROW_QUANTS = ("int4", "gguf", "int8", "none")  # a row's own target quantization (@quant=...)
_HEADS = ("medusa", "medusa+lookup", "hydra", "hydra+lookup", "eagle", "eagle+lookup", "bpd")
_TREES = ("medusa", "medusa+lookup", "hydra", "hydra+lookup", "eagle", "eagle+lookup")
# key -> (the methods that take it, who in words, what it sets)
OPTIONS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "heads": (_HEADS, "medusa, hydra, eagle and bpd",
              "a heads directory (medusa/bpd: Medusa layout; hydra: sequential heads; eagle: an EAGLE drafter)"),
    "tree": (("mcsd", *_TREES), "mcsd, medusa, hydra and eagle",
             "a tree: a k-config like 2x1x1x1, dynamic[:N[:D]], or a JSON file of paths"),
    "budget": (_TREES, "medusa, hydra and eagle",
               f"the dynamic tree's budget: {' or '.join(TREE_BUDGETS)}"),
    "lookup": (("medusa+lookup", "hydra+lookup", "eagle+lookup"), "medusa+lookup, hydra+lookup and eagle+lookup",
               "the prompt-lookup chain's length, an integer >= 1"),
    "gamma": (("sd", "lookup", "bpd"), "sd, lookup and bpd", "the draft length, an integer >= 1"),
    "quant": (OURS, "speculant's methods", f"the target's quantization on the native runtime: {', '.join(ROW_QUANTS)}"),
    "format": (OURS, "speculant's methods",
               "a response format the output must match: json (JSON mode), or a .json file holding a JSON schema"),
}
# the options a row's plain-decoding row shares with it, in the order they are written there
PLAIN_KEYS = ("quant", "format")


def keys_for(name: str) -> list[str]:
    """The option keys method ``name`` takes."""
    return [k for k, (methods, _, _) in OPTIONS.items() if name in methods]


@dataclass(frozen=True)
class MethodSpec:
    """One parsed row: ``text`` as written (the row's name in tables and JSON), the method
    ``name``, its acceptance ``rule`` and its ``options`` (values as written)."""

    text: str
    name: str
    rule: str = "exact"
    options: dict[str, str] = field(default_factory=dict, hash=False)

    @property
    def base(self) -> str:
        """The decoder's method: ``hydra+lookup`` -> ``hydra``."""
        return self.name.removesuffix("+lookup")

    @property
    def lookup(self) -> bool:
        """Whether a prompt-lookup branch joins the heads' tree."""
        return self.name in ("medusa+lookup", "hydra+lookup", "eagle+lookup")

    def int_option(self, key: str) -> int | None:
        return int(self.options[key]) if key in self.options else None


def _valid_keys(name: str) -> str:
    keys = keys_for(name)
    return f"valid keys for {name}: {', '.join(keys)}" if keys else f"{name} takes no @options"


def parse_method(text: str) -> MethodSpec:
    """Parse one method spec (see the module docstring); a :class:`ConfigError` names the bad part."""
    head, *opts = text.split("@")
    name, _, rule = head.partition(":")
    if name not in OURS + PEERS:
        raise ConfigError(f"unknown bench method {name!r} in {text!r}: choose from {', '.join(OURS + PEERS)}; "
                          "write NAME[:RULE][@KEY=VALUE]..., e.g. medusa:typical, hydra+lookup@heads=DIR")
    if rule and name in PEERS:
        raise ConfigError(f"{text}: acceptance rules apply to speculant's own methods only, not the peer row {name}")
    rule = rule or "exact"
    parse_acceptance(rule)
    options: dict[str, str] = {}
    for opt in opts:
        if opt in TREE_BUDGETS:
            key, value = "budget", opt
        elif "=" in opt:
            key, _, value = opt.partition("=")
        elif not opt:
            raise ConfigError(f"{text}: an empty option after '@'; write @KEY=VALUE ({_valid_keys(name)})")
        else:
            raise ConfigError(f"{text}: {opt!r} is not an option: a tree budget is @auto or @fixed, other options "
                              f"are @KEY=VALUE ({_valid_keys(name)})")
        if key not in OPTIONS:
            raise ConfigError(f"{text}: unknown option {key!r}; {_valid_keys(name)}")
        if name not in OPTIONS[key][0]:
            what = "a tree budget (@auto, @fixed)" if key == "budget" else f"option {key!r}"
            raise ConfigError(f"{text}: {what} applies to {OPTIONS[key][1]} only; {_valid_keys(name)}")
        if key in options:
            raise ConfigError(f"{text}: option {key!r} is given twice")
        if not value:
            raise ConfigError(f"{text}: option {key!r} has no value; write {key}=VALUE with {OPTIONS[key][2]}")
        if key == "budget" and value not in TREE_BUDGETS:
            raise ConfigError(f"{text}: budget={value!r}: a tree budget is @auto or @fixed")
        if key == "quant" and value not in ROW_QUANTS:
            raise ConfigError(f"{text}: quant={value!r}: {OPTIONS[key][2]}")
        if key in ("lookup", "gamma") and not (value.isdigit() and int(value) >= 1):
            raise ConfigError(f"{text}: {key}={value!r}: {OPTIONS[key][2]}")
        if key == "heads" and not Path(value).is_dir():
            raise ConfigError(f"{text}: heads directory {value!r} does not exist; give a directory written by "
                              "`speculant train-heads`")
        if key == "format" and value != "json" and not (value.endswith(".json") and Path(value).is_file()):
            raise ConfigError(f"{text}: format={value!r}: {OPTIONS[key][2]} (an existing file)")
        if key == "tree" and value.endswith(".json") and not Path(value).is_file():
            raise ConfigError(f"{text}: tree file {value!r} does not exist; give a JSON file of paths, "
                              "a k-config like 2x1x1x1, or dynamic[:N[:D]]")
        options[key] = value
    return MethodSpec(text, name, rule, options)


def read_tree(value: str | None) -> str | None:
    """A ``tree`` option as the decoder takes it: a ``.json`` file's text, else the value itself."""
    if value is None or not value.endswith(".json"):
        return value
    try:
        return Path(value).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read the tree file {value}: {e.strerror}") from None


def split_method(m: str) -> tuple[str, str]:
    """``"bpd:topk=2"`` -> ``("bpd", "topk=2")``; ``"sd"`` -> ``("sd", "exact")``;
    ``"hydra+lookup@fixed"`` -> ``("hydra+lookup", "exact")`` (the options: :func:`parse_method`)."""
    name, _, rule = m.partition("@")[0].partition(":")
    return name, rule or "exact"


def tree_budget_of(m: str, default: str) -> str:
    """``"hydra@fixed"`` or ``"hydra@budget=fixed"`` -> ``"fixed"``; without a budget -> ``default``."""
    return parse_method(m).options.get("budget", default)


def is_peer(m: str) -> bool:
    """Whether method ``m`` is a peer row (another runtime), not one of speculant's own."""
    return split_method(m)[0] in PEERS


def plain_of(m: str) -> str:
    """The plain-decoding row whose output ``m``'s is compared with: its own runtime's (our
    ``ar`` for speculant's methods and for hf-assisted, which runs the same transformers weights;
    ``ar@quant=Q`` for a row of ours with ``@quant=Q``, ``ar@format=F`` with ``@format=F``,
    ``ar@quant=Q@format=F`` with both)."""
    name = split_method(m)[0]
    if name in LLAMA_SERVER:
        return "llama-server"
    if name in OPENVINO:
        return "openvino"
    return "ar" + "".join(f"@{k}={v}" for k in PLAIN_KEYS if (v := row_option(m, k)) is not None)


def row_option(m: str, key: str) -> str | None:
    """The ``@KEY=VALUE`` value of row ``m`` (its options as written, not checked), else None."""
    return next((o.partition("=")[2] for o in m.split("@")[1:] if o.startswith(f"{key}=")), None)


def row_quant(m: str) -> str | None:
    """The ``@quant=Q`` of row ``m`` (its options as written, not checked), else None."""
    return row_option(m, "quant")


def response_format_of(m: str) -> dict | None:
    """The ``response_format`` a row's ``@format=`` asks for: ``json`` -> JSON mode; a ``.json``
    file -> its JSON schema, strict; none -> None (free text)."""
    value = row_option(m, "format")
    if value is None:
        return None
    if value == "json":
        return {"type": "json_object"}
    try:
        schema = json.loads(Path(value).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{m}: cannot read the JSON schema {value}: {e}") from None
    return {"type": "json_schema", "json_schema": {"name": Path(value).stem, "schema": schema, "strict": True}}
