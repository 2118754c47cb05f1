"""The bench's model pair, checked before any model loads or any row is timed, and the files each
peer row runs.

``speculant bench --target X --draft Y`` takes any pair of specs (a preset, a ``.gguf`` file, a
transformers directory; ``store.models``). Before anything loads, :func:`check_spec` refuses a
spec that names nothing, and when a row drafts with ``Y`` (:data:`DRAFT_ROWS`) :func:`check_pair`
refuses a pair that cannot or should not draft: vocabularies that differ
(``store.models.check_vocab_compatible``, on the two tokenizers alone) or a draft larger than the
target (layers x hidden², as the decoder's own warning measures it). Each is a one-line
:class:`~speculant.errors.ConfigError` (or ``VocabMismatchError``).

:func:`plan_peers` says what each peer row runs, with no runtime started:

- ``llama-server*``: the target's GGUF (``-m``) and for ``llama-server+draft`` the draft's
  (``-md``): the file given, a preset's assembled file, or the GGUF a speculant cache directory
  was converted from (``store.models.gguf_path``). A transformers directory has no GGUF: its rows
  are skipped with a line that says so.
- ``openvino*``: the int4 IR exported for the target (and the draft) (``bench.openvino.ir_dir``);
  where none was exported, the rows are skipped with the command that exports it.
- ``hf-assisted``: the two models speculant loads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ModelLoadError, SpeculantError
from ..store.models import COMPLETE_MARKER, cache_dir, check_vocab_compatible, gguf_path, is_gguf
from ..store.presets import PRESETS
from .methods import LLAMA_SERVER, OPENVINO, split_method
from .openvino import ir_dir, missing_ir

DRAFT_ROWS = ("sd", "mcsd", "hf-assisted", "llama-server+draft", "openvino+draft")
SIBLINGS = "docs/methods.md#sibling-drafts"  # how to get a draft of the target's family


def uses_draft(method: str) -> bool:
    """Whether bench row ``method`` drafts with the draft model."""
    return split_method(method)[0] in DRAFT_ROWS


def check_spec(spec: str | os.PathLike, option: str) -> None:
    """A ConfigError unless ``spec`` (given as ``option``, e.g. ``--target``) is a preset, a GGUF
    file or a transformers model directory."""
    if str(spec) in PRESETS:
        return
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(f"{option} {spec}: no such file or directory, nor a preset; give a .gguf file, a "
                          f"transformers model directory or a preset ({', '.join(PRESETS)})")
    if path.is_file() and not is_gguf(path):
        raise ConfigError(f"{option} {spec} is not a GGUF file (it does not start with 'GGUF'); give a .gguf "
                          "file, a transformers model directory or a preset")
    if path.is_dir() and not (path / "config.json").is_file():
        inside = sorted(path.glob("*.gguf"))
        hint = f"; to use the GGUF inside, pass {inside[0]}" if inside else ""
        raise ConfigError(f"{option} {spec} is a directory without config.json, not a transformers model "
                          f"directory{hint}")


@dataclass(frozen=True)
class ModelFacts:
    """What the pair check reads of a model without its weights: ``name`` (as ``LoadedModel``
    names it), ``tokenizer`` (a transformers tokenizer) and its shape."""

    name: str
    tokenizer: Any
    layers: int
    hidden: int

    @property
    def size(self) -> int:
        """layers x hidden², the decoder's measure of a model's cost per pass."""
        return self.layers * self.hidden ** 2


def _converted(spec: str) -> Path | None:
    """A complete speculant conversion of the preset or GGUF file ``spec`` in the cache (any
    dtype: tokenizer and config are the same), found by its marker; None if there is none."""
    preset = PRESETS.get(spec)
    path = None if preset else Path(spec).expanduser().resolve()
    st = path.stat() if path is not None else None
    for marker in sorted((cache_dir() / "models").glob(f"*/{COMPLETE_MARKER}")):
        try:
            m = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if preset is not None:
            match = m.get("preset") == preset.name and m.get("sha256") == preset.sha256
        else:
            match = (m.get("source") == str(path) and m.get("size") == st.st_size
                     and m.get("mtime_ns") == st.st_mtime_ns)
        if match and (marker.parent / "config.json").is_file():
            return marker.parent
    return None


def _gguf_shape(gguf: Path) -> tuple[int, int]:
    """(layers, hidden) from a GGUF's metadata."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))

    def value(key: str):
        field = reader.get_field(key)
        return None if field is None else field.contents()

    arch = value("general.architecture")
    return int(value(f"{arch}.block_count") or 0), int(value(f"{arch}.embedding_length") or 0)


def model_facts(spec: str | os.PathLike, role: str) -> ModelFacts:
    """The tokenizer and shape of model ``spec`` (the ``role``: "target" or "draft"): from its
    directory, a cached conversion, or the GGUF itself (the tokenizer as the conversion reads it)."""
    from transformers import AutoTokenizer

    s = str(spec)
    name = s if s in PRESETS else Path(s).name
    path = Path(s).expanduser()
    directory = path if s not in PRESETS and (path / "config.json").is_file() else _converted(s)
    try:
        if directory is not None:
            config = json.loads((directory / "config.json").read_text())
            text = config.get("text_config") or config
            layers, hidden = int(text.get("num_hidden_layers") or 0), int(text.get("hidden_size") or 0)
            tokenizer = AutoTokenizer.from_pretrained(str(directory))
        else:
            gguf = gguf_path(s)  # a preset: assembled and checked once
            layers, hidden = _gguf_shape(gguf)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.resolve().parent), gguf_file=str(gguf.resolve()))
    except SpeculantError:
        raise
    except Exception as e:  # noqa: BLE001 - the GGUF reader and the tokenizer raise many kinds
        raise ModelLoadError(f"cannot read the {role} {s}'s tokenizer and config: {type(e).__name__}: {e}") from None
    return ModelFacts(name, tokenizer, layers, hidden)


def check_pair(target: str | os.PathLike, draft: str | os.PathLike) -> None:
    """Refuse a draft that cannot draft for ``target`` (another vocabulary or eos id) or costs more
    per pass than it (larger); one line each. Reads tokenizers and configs only."""
    t, d = model_facts(target, "target"), model_facts(draft, "draft")
    check_vocab_compatible(t, d)
    if d.size > t.size > 0:
        raise ConfigError(f"the draft {d.name!r} ({d.layers} layers x {d.hidden}) is larger than the target "
                          f"{t.name!r} ({t.layers} layers x {t.hidden}): every drafted token would cost more than "
                          f"the target's own pass; give a smaller model of the target's family as --draft "
                          f"({SIBLINGS}), or leave {', '.join(DRAFT_ROWS)} out of --methods")


@dataclass(frozen=True)
class PeerFiles:
    """What a peer row runs: the target's and the draft's model files (GGUF files for llama-server,
    IR directories for OpenVINO; None where the row needs none), or ``skip``: why it cannot run."""

    target: Path | None = None
    draft: Path | None = None
    skip: str | None = None


def _no_gguf(spec: str, role: str) -> str:
    return (f"llama-server runs GGUF files, and the {role} {spec} is a transformers directory with none behind "
            f"it: give a .gguf file as --{role} (llama.cpp's convert_hf_to_gguf.py makes one: {SIBLINGS})")


def plan_peers(methods, target: str | os.PathLike, draft: str | os.PathLike | None) -> dict[str, PeerFiles]:
    """Each peer row of ``methods`` -> the files it runs for this pair (or why it is skipped);
    speculant's own rows are left out. Nothing is started; a preset's GGUF is assembled once."""
    ggufs: dict[str, Path | None] = {}

    def gguf(spec) -> Path | None:
        if str(spec) not in ggufs:
            ggufs[str(spec)] = gguf_path(spec)
        return ggufs[str(spec)]

    plans = {}
    for m in methods:
        name = split_method(m)[0]
        drafts = name in DRAFT_ROWS
        if drafts and draft is None:
            plans[m] = PeerFiles(skip=no_draft(target))
        elif name in LLAMA_SERVER:
            t, d = gguf(target), gguf(draft) if drafts else None
            if t is None:
                plans[m] = PeerFiles(skip=_no_gguf(str(target), "target"))
            elif drafts and d is None:
                plans[m] = PeerFiles(skip=_no_gguf(str(draft), "draft"))
            else:
                plans[m] = PeerFiles(t, d)
        elif name in OPENVINO:
            why = missing_ir(target) or (missing_ir(draft) if drafts else None)
            plans[m] = PeerFiles(skip=why) if why else PeerFiles(ir_dir(target), ir_dir(draft) if drafts else None)
        elif name == "hf-assisted":
            plans[m] = PeerFiles()  # transformers' generate on the two models speculant loads
    return plans


def no_draft(target: str | os.PathLike) -> str:
    """Why a drafting row cannot run when no --draft was given for ``target``."""
    return (f"no --draft was given for the target {target}: name a smaller model of its tokenizer family "
            f"({SIBLINGS})")
