"""Model specs: a transformers directory, a ``.gguf`` file, or a preset of the installed packages.

A *spec* is what a user types after ``--target`` / ``--draft``:

(a) a transformers model directory (``config.json`` + safetensors + tokenizer files): used as is;
(b) a path to a ``.gguf`` file: converted once to a safetensors cache directory;
(c) a preset name (``PRESETS``): the GGUF is assembled from pip packages that carry its parts,
    its size and SHA-256 are checked, then it is converted like (b).

Why convert: transformers dequantizes every GGUF tensor at load time (27–85 s here); the same
weights saved as safetensors in the dtype they will be loaded in reload in about a second. Cache
in the dtype you load: loading fp32 safetensors with ``dtype=bfloat16`` peaks far higher than
either (10.6 GB for the Qwen pair), so there is one cache directory per dtype.

Cache layout (root: ``$SPECULANT_CACHE`` or ``~/.cache/speculant``)::

    gguf/<filename>                               assembled multi-part GGUF (verified SHA-256)
    models/<name>-<key12>-<bfloat16|float32>/     converted model + tokenizer + COMPLETE marker

``key12`` is the first 12 hex digits of the preset's SHA-256, or for an arbitrary ``.gguf`` file a
hash of its name, size and mtime (a warm load must not hash a 1 GB file). A conversion writes
into a hidden temporary directory beside the target and renames it into place only once the
marker is written, so an interrupted conversion never leaves a directory that looks complete;
the next conversion of that model (under the same lock) removes such leftovers. A cache entry
whose safetensors file is damaged (e.g. truncated) is named and converted again, as is one
converted before the config fields of ``store.gguf_meta`` (Gemma 2's soft caps and query scale) were set.
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from . import gguf_meta
from ..errors import ConfigError, ModelLoadError, VocabMismatchError
from .presets import PRESETS, Part, Preset  # noqa: F401 - re-exported: models.PRESETS is public
from ..runtime.process import cache_dir, file_lock  # cache_dir re-exported
from ..runtime.weights import weights_of

GGUF_MAGIC = b"GGUF"
COMPLETE_MARKER = "SPECULANT_COMPLETE.json"
_CHUNK = 8 << 20  # bytes per read while assembling / hashing
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------------------------
# Cache, progress, small helpers
# --------------------------------------------------------------------------------------------


def _say(msg: str) -> None:
    print(f"speculant: {msg}", file=sys.stderr, flush=True)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16):
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ConfigError(f"unsupported dtype {dtype!r}; use 'bfloat16' (fast on CPU) or 'float32' "
                      "(exact greedy equality checks)")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sha256(path: Path, desc: str) -> str:
    from tqdm.auto import tqdm

    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     desc=desc, file=sys.stderr, leave=False) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _share(path: Path) -> None:
    """Make a cache entry readable by all (mkdtemp/mkstemp create it private)."""
    for p in [path, *path.iterdir()] if path.is_dir() else [path]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


def _is_complete(directory: Path) -> bool:
    return (directory / COMPLETE_MARKER).is_file() and (directory / "config.json").is_file()


def damaged_weights(directory: Path) -> str | None:
    """Why a safetensors file of ``directory`` cannot be read (the first bad file named), or None
    if every one opens. Opening reads only a file's header and checks that the header covers the
    file exactly, so a truncated or overlong file is caught in milliseconds."""
    from safetensors import safe_open

    for f in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            return f"{f.name} cannot be read ({type(e).__name__}: {e}; {f.stat().st_size:,} bytes)"
    return None


def _damage(target: Path) -> str | None:
    """What is wrong with the complete cache entry ``target`` (damaged weights or outdated), or None."""
    if not any(target.glob("*.safetensors")):
        return "is damaged: it has no *.safetensors file"
    why = damaged_weights(target)
    return f"is damaged: {why}" if why else gguf_meta.outdated(target / COMPLETE_MARKER)


def _usable(target: Path) -> bool:
    """A complete, current entry whose weights open; a damaged or outdated one is named (converted again)."""
    if not _is_complete(target):
        return False
    why = _damage(target)
    if why is not None:
        _say(f"the converted model {target} {why}; converting it again")
        return False
    return True


def _remove_leftovers(target: Path) -> None:
    """Remove temporary directories of earlier conversions of ``target`` that were killed (called
    with the conversion lock held: no live conversion of ``target`` has one then)."""
    for left in sorted(target.parent.glob(f".{target.name}.*.tmp")):
        _say(f"an earlier conversion of {target.name} was interrupted: removing its partial output {left}")
        shutil.rmtree(left, ignore_errors=True)


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# Assembly of a preset's GGUF
# --------------------------------------------------------------------------------------------


def _locate_parts(preset: Preset) -> list[Path]:
    found = [part.locate() for part in preset.parts]
    missing = tuple(part.requirement for part, path in zip(preset.parts, found) if path is None)
    if missing:
        how = ("" if preset.optional else "run `make install`, or ")
        raise ModelLoadError(
            f"preset {preset.name!r} needs packages that are not installed: {', '.join(missing)}. "
            f"To fix: {how}`{preset.pip_command(missing)}` "
            f"(--no-deps matters: some of these packages pull in unrelated software)")
    return [p for p in found if p is not None]


def _corrupt(preset: Preset, path: Path, what: str, delete: bool) -> ModelLoadError:
    if delete:
        path.unlink(missing_ok=True)
    where = f"{path} (deleted)" if delete else str(path)
    return ModelLoadError(
        f"the GGUF of preset {preset.name!r} is corrupt: {what}; file {where}. Reinstall its "
        f"packages and retry: `{preset.pip_command(force=True)}`")


def assemble_gguf(preset: Preset) -> Path:
    """The preset's verified GGUF file: its single part in place, or parts concatenated into
    ``<cache>/gguf/<filename>`` (once). Size and SHA-256 are checked on every call; a mismatch
    raises ModelLoadError (and deletes an assembled file)."""
    parts = _locate_parts(preset)
    if len(parts) == 1:
        target, delete = parts[0], False
    else:
        target, delete = cache_dir() / "gguf" / preset.filename, True
        if not (target.is_file() and target.stat().st_size == preset.size):
            _concatenate(parts, target, preset.size)
    size = target.stat().st_size
    if size != preset.size:
        raise _corrupt(preset, target, f"{size:,} bytes instead of {preset.size:,}", delete)
    digest = _sha256(target, f"checking {preset.filename}")
    if digest != preset.sha256:
        raise _corrupt(preset, target, f"SHA-256 {digest} instead of {preset.sha256}", delete)
    return target


@contextlib.contextmanager
def _writing_cache(where: Path):
    """An OSError while writing the model cache (unwritable, missing, full) as a clear error; the
    writers themselves leave nothing half-written (temporary names, renamed when complete)."""
    try:
        yield
    except OSError as e:
        raise ModelLoadError(
            f"cannot write the model cache at {where}: {e.strerror or e}. Set SPECULANT_CACHE to a writable "
            "directory with room for the converted model (about 2 bytes per parameter in bf16)") from None


def _concatenate(parts: list[Path], target: Path, total: int) -> None:
    with _writing_cache(target.parent):
        _concatenate_parts(parts, target, total)


def _concatenate_parts(parts: list[Path], target: Path, total: int) -> None:
    from tqdm.auto import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr,
                                              desc=f"assembling {target.name}") as bar:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        out.write(chunk)
                        bar.update(len(chunk))
        _share(Path(tmp))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------------------------
# GGUF -> safetensors conversion
# --------------------------------------------------------------------------------------------


def _convert(gguf: Path, target: Path, dtype: torch.dtype, source: dict[str, Any]) -> Path:
    """Dequantize ``gguf`` with transformers and save model + tokenizer as ``target`` (atomic)."""
    with _writing_cache(target.parent):
        return _convert_to(gguf, target, dtype, source)


def _convert_to(gguf: Path, target: Path, dtype: torch.dtype, source: dict[str, Any]) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not is_gguf(gguf):
        raise ModelLoadError(f"{gguf} is not a GGUF file (it does not start with the magic bytes "
                             "'GGUF'); pass a valid .gguf file, a transformers model directory, "
                             f"or one of the presets: {', '.join(PRESETS)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # one conversion of a model at a time (two 1 GB conversions at once on 2 cores double the memory peak)
    with file_lock(target.parent / ".locks" / f"{target.name}.lock"):
        if _is_complete(target) and _damage(target) is None:  # another process finished it meanwhile
            return target
        _remove_leftovers(target)
        t0 = time.perf_counter()
        _say(f"converting {gguf.name} to {_dtype_name(dtype)} safetensors in {target} "
             "(one time only; dequantizing takes 30-90 s)")
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            kw = dict(gguf_file=str(gguf.resolve()))
            try:
                # transformers warns that packed GGUF weights run fastest in float32: irrelevant
                # here, the weights are dequantized and saved.
                with _transformers_quiet():
                    tokenizer = AutoTokenizer.from_pretrained(str(gguf.resolve().parent), **kw)
                    model = AutoModelForCausalLM.from_pretrained(str(gguf.resolve().parent),
                                                                 dtype=dtype, **kw)
            except Exception as e:
                raise ModelLoadError(
                    f"transformers could not load the GGUF file {gguf}: {type(e).__name__}: {e}. "
                    "Check that its architecture is supported by transformers' GGUF loader, or "
                    "convert it to a transformers model directory and pass that instead") from e
            # The weights are dequantized now: drop the GGUF quantizer so save_pretrained writes
            # plain tensors and the saved config has no quantization_config to reload through.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            gguf_meta.apply(model.config, gguf)  # the config fields transformers' loader does not read
            _say(f"loaded in {time.perf_counter() - t0:.0f} s; writing safetensors")
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            del model
            gc.collect()
            marker = {**source, "dtype": _dtype_name(dtype), "converted_at": time.time(),
                      "seconds": round(time.perf_counter() - t0, 1), "config_fixes": gguf_meta.VERSION}
            (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            _share(tmp)
            if target.exists():  # an incomplete or damaged entry: replace it
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _say(f"converted {gguf.name} in {time.perf_counter() - t0:.0f} s")
    return target


def _gguf_origin(spec: str | os.PathLike) -> Preset | Path | None:
    """Where the GGUF file behind ``spec`` comes from, read the way :func:`resolve` reads ``spec``
    and without assembling or hashing anything: the preset (for its name, or for a cache directory
    converted from it), the ``.gguf`` file (given, or the one a cache directory was converted from,
    if it still exists), or None (a plain transformers directory, or no such file)."""
    path = Path(spec).expanduser()
    if path.is_dir() and ((path / "config.json").is_file() or str(spec) not in PRESETS):
        try:
            source = json.loads((path / COMPLETE_MARKER).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(source, dict):
            return None
        if source.get("preset") in PRESETS:
            return PRESETS[source["preset"]]
        return Path(source["source"]) if source.get("source") and Path(source["source"]).is_file() else None
    if path.is_file():
        return path if is_gguf(path) else None
    return PRESETS.get(str(spec))


def gguf_path(spec: str | os.PathLike) -> Path | None:
    """The GGUF file behind ``spec``: a preset's assembled and verified file (assembled once, see
    ``assemble_gguf``), the file itself for a ``.gguf`` path, or for a speculant cache directory
    the GGUF it was converted from (if it still exists). None for a plain transformers directory."""
    origin = _gguf_origin(spec)
    return assemble_gguf(origin) if isinstance(origin, Preset) else origin


def has_gguf_source(spec: str | os.PathLike) -> bool:
    """Whether :func:`gguf_path` finds a GGUF file behind ``spec``, without assembling or hashing it."""
    return _gguf_origin(spec) is not None


def _gguf_file_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.name}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]


def _no_such_model(spec: str) -> ModelLoadError:
    close = difflib.get_close_matches(spec, PRESETS, n=1) or [p for p in PRESETS if p.startswith(spec)][:1]
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ModelLoadError(f"no such model: {spec}{hint}; expected a transformers model directory, "
                          f"a .gguf file, or one of the presets: {', '.join(PRESETS)}")


def resolve(spec: str | os.PathLike, dtype: str | torch.dtype = torch.bfloat16) -> Path:
    """A transformers model directory for ``spec`` (see module docstring), converting once."""
    dtype = parse_dtype(dtype)
    path = Path(spec).expanduser()
    model_dir = (path / "config.json").is_file()
    # a preset's bare name is the preset, even where a directory of that name holds other things
    # (a corpus or a drafter written under the model's name)
    if path.is_dir() and (model_dir or str(spec) not in PRESETS):
        if model_dir:
            return path
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"; to use the GGUF file inside, pass {ggufs[0]}" if ggufs else ""
        raise ModelLoadError(f"{path} is a directory but not a transformers model directory "
                             f"(it has no config.json){hint}")
    if path.is_file():
        if not is_gguf(path):
            raise ModelLoadError(
                f"{path} is not a GGUF file (it does not start with the magic bytes 'GGUF'); "
                "expected a transformers model directory, a .gguf file, or one of the presets: "
                f"{', '.join(PRESETS)}")
        target = cache_dir() / "models" / f"{path.stem}-{_gguf_file_key(path)}-{_dtype_name(dtype)}"
        if _usable(target):
            return target
        st = path.stat()
        return _convert(path, target, dtype, {"source": str(path.resolve()), "size": st.st_size,
                                              "mtime_ns": st.st_mtime_ns})
    preset = PRESETS.get(str(spec))
    if preset is None:
        raise _no_such_model(str(spec))
    target = cache_dir() / "models" / f"{preset.name}-{preset.sha256[:12]}-{_dtype_name(dtype)}"
    if _usable(target):  # warm: no package lookup, no hashing
        return target
    gguf = assemble_gguf(preset)
    return _convert(gguf, target, dtype, {"preset": preset.name, "sha256": preset.sha256,
                                          "packages": list(preset.packages)})


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for inference: eval mode, no gradients, on CPU.

    name: the preset name or the directory / file name; path: the transformers directory loaded.
    """

    name: str
    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers tokenizer
    path: Path
    dtype: torch.dtype

    @property
    def logits_dim(self) -> int:
        """Width of the logits (lm_head out_features); may exceed len(vocab) through padding."""
        return weights_of(self.model.get_output_embeddings()).weight_shape[0]  # dense or quantized (runtime.weights)


def load(spec: str | os.PathLike, dtype: str | torch.dtype = "bfloat16") -> LoadedModel:
    """Resolve ``spec`` (converting a GGUF once) and load it in ``dtype`` with sdpa attention, or
    eager attention for an architecture transformers has no sdpa path for (Gemma 2: its
    attention logits are soft-capped)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = parse_dtype(dtype)
    path = resolve(spec, dtype)
    try:
        with _transformers_quiet():  # a warm load takes seconds: no progress bars
            tokenizer = AutoTokenizer.from_pretrained(str(path))
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                         attn_implementation=_attention_for(path))
    except Exception as e:
        why = damaged_weights(path)
        what = f"{why}" if why else f"{type(e).__name__}: {e}"
        raise ModelLoadError(f"could not load the model directory {path}: {what}. "
                             "If it is a speculant cache directory, delete it to have it "
                             "converted again") from e
    model.eval()
    model.requires_grad_(False)
    name = str(spec) if str(spec) in PRESETS else Path(spec).name
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, path=path, dtype=dtype)


def _attention_for(path: Path) -> str:
    """"sdpa", or "eager" where transformers' class for the model has no sdpa attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(path))
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, OSError, ValueError):
        return "sdpa"  # loading says what is wrong
    return "sdpa" if getattr(cls, "_supports_sdpa", True) else "eager"


def check_vocab_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise VocabMismatchError unless draft and target share one tokenizer vocabulary.

    Equal vocabularies (same token -> id map) and the same eos id are required: a draft token id
    must mean the same string to the target. The logits width (lm_head out_features) may differ
    while the vocabularies are equal (one model padded its output layer): the decoder compares
    distributions over the common prefix ``min(target.logits_dim, draft.logits_dim)``, which
    holds every real token.
    """
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    fix = ("the draft must share the target's tokenizer (e.g. pair qwen2.5-coder-0.5b-instruct "
           "as draft with qwen2.5-coder-1.5b-instruct as target), or use a draft-free method "
           "such as prompt lookup")
    if tv != dv:
        only_t = sorted(set(tv) - set(dv), key=tv.get)
        only_d = sorted(set(dv) - set(tv), key=dv.get)
        moved = sorted((t for t in set(tv) & set(dv) if tv[t] != dv[t]), key=tv.get)
        details = []
        if only_t:
            details.append(f"only in the target: {', '.join(f'{t!r}={tv[t]}' for t in only_t[:5])}")
        if only_d:
            details.append(f"only in the draft: {', '.join(f'{t!r}={dv[t]}' for t in only_d[:5])}")
        if moved:
            details.append("different ids: " + ", ".join(f"{t!r} {tv[t]} vs {dv[t]}" for t in moved[:5]))
        raise VocabMismatchError(
            f"the draft {draft.name!r} ({len(dv):,} tokens) and the target {target.name!r} "
            f"({len(tv):,} tokens) have different vocabularies ({'; '.join(details)}); {fix}")
    te, de = target.tokenizer.eos_token_id, draft.tokenizer.eos_token_id
    if te != de:
        raise VocabMismatchError(f"the draft {draft.name!r} and the target {target.name!r} have "
                                 f"different eos token ids ({de} vs {te}); {fix}")
