"""A crash never leaves anything a later run trusts: processes killed with SIGKILL in the middle of
converting a model or saving the int4 model, two conversions racing, and damaged cache files
(a truncated converted model, a truncated int4 model, a broken pass-cost file). Tiny models: seconds
each. The kernel build killed mid-compile: test_crash_kernels.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from crash_helpers import Child, visible
from test_models import _write_tiny_gguf
from speculant.store import models
from speculant.errors import ModelLoadError

# ---------------------------------------------------------------------------------- conversion

CONVERT_AND_PAUSE = r"""
import os, sys, time, torch
from pathlib import Path
from speculant.store import models
gguf, point, ready = sys.argv[1:4]

def pause():
    Path(ready).write_text(str(os.getpid()))
    time.sleep(600)  # killed here

if point == "weights":  # model.safetensors and config.json written to the temporary directory, nothing else yet
    from transformers import PreTrainedModel
    save = PreTrainedModel.save_pretrained
    def save_then_pause(self, *a, **k):
        save(self, *a, **k)
        pause()
    PreTrainedModel.save_pretrained = save_then_pause
else:  # "marker": everything written, the completion marker too; killed right before the rename
    models._share = lambda path: pause()
models.resolve(gguf, torch.float32)
"""


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    # own copies: the file may be overwritten in place later, under a mapping
    return {k: v.clone() for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _assert_same_model(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    la, lb = models.load(str(a), "float32"), models.load(str(b), "float32")
    assert la.tokenizer.get_vocab() == lb.tokenizer.get_vocab()
    ids = torch.tensor([[1, 3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(la.model(ids).logits, lb.model(ids).logits)


@pytest.fixture
def gguf(tmp_path) -> Path:
    return _write_tiny_gguf(tmp_path / "tiny.gguf")


@pytest.mark.parametrize("point", ["weights", "marker"])
def test_conversion_killed_midway_is_never_trusted(tmp_path, monkeypatch, capsys, gguf, point):
    """SIGKILL with the weights written (no marker), or with everything written and the marker too
    (before the rename): no entry looks converted; the next run names the leftover, removes it,
    converts again, and its result equals a clean conversion."""
    cache = tmp_path / "cache"
    ready = tmp_path / "ready"
    child = Child(CONVERT_AND_PAUSE, gguf, point, ready, log=tmp_path / "child", env={"SPECULANT_CACHE": str(cache)})
    child.wait_until(ready.exists, 120, "the pause inside the conversion")
    child.kill()
    names = visible(cache / "models")
    partial = [n for n in names if n.endswith(".tmp")]
    assert len(partial) == 1 and partial[0].startswith(".") and names == sorted([".locks", *partial]), names
    left = cache / "models" / partial[0]
    assert (left / "model.safetensors").is_file()  # the kill left real partial output behind
    assert (left / models.COMPLETE_MARKER).is_file() == (point == "marker")

    monkeypatch.setenv("SPECULANT_CACHE", str(cache))
    capsys.readouterr()
    target = models.resolve(str(gguf), torch.float32)
    err = capsys.readouterr().err
    assert f"an earlier conversion of {target.name} was interrupted: removing its partial output {left}" in err
    assert "converting tiny.gguf" in err and "converted tiny.gguf" in err
    assert visible(cache / "models") == [".locks", target.name]
    assert models.resolve(str(gguf), torch.float32) == target and capsys.readouterr().err == ""  # warm now

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "clean"))
    clean = models.resolve(str(gguf), torch.float32)
    assert clean.name == target.name
    _assert_same_model(target, clean)


RACE = r"""
import hashlib, sys, time, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer  # imported before the start signal
from speculant.store import models
gguf, ready, go, out = sys.argv[1:5]
Path(ready).touch()
deadline = time.monotonic() + 60
while not Path(go).exists():
    if time.monotonic() > deadline:
        sys.exit("no start signal")
    time.sleep(0.005)
lm = models.load(gguf, "float32")
h = hashlib.sha256()
for name, t in sorted(lm.model.state_dict().items()):
    h.update(name.encode())
    h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
Path(out).write_text(f"{lm.path}\n{h.hexdigest()}\n")
"""


def test_two_processes_converting_the_same_model_at_once(tmp_path, gguf):
    """Started together on an empty cache: both succeed, exactly one converts, one cache entry
    and the lock directory remain, and both loaded the same weights."""
    cache = tmp_path / "cache"
    children = []
    for i in range(2):
        args = (gguf, tmp_path / f"ready{i}", tmp_path / "go", tmp_path / f"out{i}")
        children.append(Child(RACE, *args, log=tmp_path / f"child{i}", env={"SPECULANT_CACHE": str(cache)}))
    for i, child in enumerate(children):
        child.wait_until((tmp_path / f"ready{i}").exists, 120, "the start line")
    (tmp_path / "go").touch()
    for child in children:
        assert child.finish(180) == 0, child.stderr()[-3000:]
    results = [(tmp_path / f"out{i}").read_text().split() for i in range(2)]
    assert results[0] == results[1]  # the same directory, the same weights
    target = Path(results[0][0])
    assert visible(cache / "models") == [".locks", target.name]
    assert sum("converting tiny.gguf" in c.stderr() for c in children) == 1
    assert models._is_complete(target) and models.damaged_weights(target) is None


@pytest.mark.parametrize("cut", ["half", "empty"])
def test_damaged_weights_in_a_complete_conversion_are_named_and_converted_again(tmp_path, monkeypatch, capsys, gguf,
                                                                              cut):
    from speculant.store.loading import load_native

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    target = models.resolve(str(gguf), torch.float32)
    good = _weights(target)
    weights = target / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2] if cut == "half" else b"")
    assert models._is_complete(target)  # the marker says complete; the weights say otherwise

    # a directory given as is: a clear error naming the file and the fix
    for load in (lambda: models.load(str(target), "float32"), lambda: load_native(str(target), "float32")):
        with pytest.raises(ModelLoadError, match=r"model\.safetensors.*delete") as e:
            load()
        assert str(target) in str(e.value)
    # the GGUF it came from: named once, converted again, identical to the first conversion
    capsys.readouterr()
    assert models.resolve(str(gguf), torch.float32) == target
    err = capsys.readouterr().err
    assert f"the converted model {target} is damaged: model.safetensors cannot be read" in err
    assert err.count(" is damaged: ") == 1 and "converting tiny.gguf" in err
    again = _weights(target)
    assert again.keys() == good.keys() and all(torch.equal(again[k], good[k]) for k in good)
    assert visible(target.parent) == [".locks", target.name]


# ---------------------------------------------------------------------------------- int4 model


def _x86_kernels_ready() -> bool:
    from speculant.kernels import x86_kernels

    return x86_kernels() is not None


needs_int4 = pytest.mark.skipif(not _x86_kernels_ready(), reason="needs speculant's x86 int4 kernel")

SAVE_AND_PAUSE = r"""
import os, sys, time, torch
from pathlib import Path
from speculant.backends import native_store
from speculant.backends.native_model import NativeModel
src, ready = sys.argv[1:3]
write = native_store._write_safetensors

def write_part_then_pause(path, tensors, metadata):
    write(path, tensors, metadata)
    os.truncate(path, path.stat().st_size // 2)  # the kill lands in the middle of the write
    Path(ready).write_text(str(path))
    time.sleep(600)

native_store._write_safetensors = write_part_then_pause
NativeModel.from_dir(src, torch.bfloat16, "int4", quant_head=True)
"""


def _int4_logits(src: Path) -> torch.Tensor:
    from speculant.backends.native import NativeBackend, NativeModel

    model = NativeModel.from_dir(src, torch.bfloat16, "int4", quant_head=True)
    return NativeBackend(model).forward(torch.arange(3, 15)).logits


@pytest.fixture
def int4_source(tmp_path, monkeypatch) -> tuple[Path, torch.Tensor]:
    """A tiny bf16 Qwen2 directory and its int4 logits from a clean cache (then a fresh cache).
    The x86 kernel's layout on every CPU (the saved file is the same format for both layouts)."""
    from tiny import tiny_qwen2

    monkeypatch.setenv("SPECULANT_INT4_ISA", "portable")
    src = tmp_path / "m"
    tiny_qwen2(seed=3, dtype=torch.bfloat16).save_pretrained(src)
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "clean"))
    reference = _int4_logits(src)
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    return src, reference


@needs_int4
def test_int4_save_killed_midway_is_never_trusted(tmp_path, capsys, int4_source):
    src, reference = int4_source
    ready = tmp_path / "ready"
    env = {"SPECULANT_CACHE": str(tmp_path / "cache"), "SPECULANT_INT4_ISA": "portable"}
    child = Child(SAVE_AND_PAUSE, src, ready, log=tmp_path / "child", env=env)
    child.wait_until(ready.exists, 120, "the pause inside the int4 save")
    partial = Path(ready.read_text())
    child.kill()
    native = tmp_path / "cache" / "native"
    assert partial.is_file() and partial.name.startswith(".") and partial.name.endswith(".tmp")
    assert not [n for n in visible(native) if n.endswith(".safetensors")]  # nothing under the final name

    capsys.readouterr()
    assert torch.equal(_int4_logits(src), reference)
    err = capsys.readouterr().err
    assert f"removing {partial}, left by an interrupted save" in err and "quantizing m to int4 once" in err
    (store,) = [n for n in visible(native) if n.endswith(".safetensors")]
    assert visible(native) == sorted([store, store + ".lock"])
    assert torch.equal(_int4_logits(src), reference) and capsys.readouterr().err == ""  # read back, silently


@needs_int4
@pytest.mark.parametrize("damage", ["data cut", "header cut", "empty", "overlong"])
def test_damaged_int4_model_file_is_named_and_rebuilt(tmp_path, capsys, int4_source, damage):
    from speculant.backends.native import NativeModel

    src, reference = int4_source
    assert torch.equal(_int4_logits(src), reference)
    (store,) = (tmp_path / "cache" / "native").glob("*.safetensors")
    data = store.read_bytes()
    bad = {"data cut": data[:len(data) - 100], "header cut": data[:20], "empty": b"", "overlong": data + b"\0" * 64}
    tmp = store.with_name("replacement")
    tmp.write_bytes(bad[damage])
    tmp.replace(store)  # a new inode, as every writer here makes (the old model maps the old file)
    capsys.readouterr()
    assert torch.equal(_int4_logits(src), reference)
    err = capsys.readouterr().err
    assert err.count(f"ignoring the saved int4 model {store}") == 1 and "rebuilding it" in err
    assert store.read_bytes() == data  # rewritten whole
    with pytest.MonkeyPatch.context() as m:
        m.setattr(NativeModel, "_read_dir", lambda *a, **k: pytest.fail("quantized again"))
        assert torch.equal(_int4_logits(src), reference)


# ---------------------------------------------------------------------------------- pass-cost file

GOOD = {"version": 3, "curves": {"other machine": {"rows": [1, 2], "ms": [1.0, 2.0], "context": 4, "slope": []}}}


@pytest.mark.parametrize("content", [
    b'{"version": 3, "curves": {"other', b"{not json", b"\xff\xfe\x00", b"[1, 2]", b"null", b'"text"',
    b'{"version": 3, "curves": [1]}', b'{"version": 3, "curves": {"m": "garbage"}}',
    b'{"version": 3, "curves": {"m": {"rows": [1, 2], "ms": [5.0, 1.0], "context": 4, "slope": []}}}',
], ids=["truncated", "not json", "not utf-8", "list", "null", "string", "curves list", "entry text",
        "entry decreasing"])
def test_damaged_pass_cost_file_is_named_and_measured_over(tmp_path, monkeypatch, capsys, content):
    import speculant.tuning.costmodel as cm
    from speculant.backends.hf import HFBackend
    from speculant.tuning.costmodel import pass_cost
    from tiny import tiny_llama

    monkeypatch.setattr(cm, "BUSY_WAIT", float("inf"))  # cache the measurement even if other jobs hold the cores
    path = tmp_path / "pass_cost.json"
    path.write_bytes(content)
    backend = HFBackend(tiny_llama(seed=0, vocab=64, hidden=32))
    cost = pass_cost(backend, "m", path=path, widths=(1, 2), context=4, long_context=0, reps=1)
    assert cost.rows == (1, 2)
    err = capsys.readouterr().err
    assert f"ignoring the pass-cost cache {path}" in err and "measuring again" in err
    saved = json.loads(path.read_text())
    assert saved["version"] == 3 and saved["curves"]["m"]["rows"] == [1, 2]
    path.write_text(json.dumps(GOOD))  # a healthy file: read, not measured, no message
    assert pass_cost(backend, "other machine", path=path).ms == (1.0, 2.0)
    assert capsys.readouterr().err == ""

