"""The user docs: README.md stays short, every relative link in README.md and docs/ points at a
file that exists, and the MkDocs site builds with --strict (no warnings)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250

# [text](target) and [text](target "title"); images too. Reference-style links are not used.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def relative_links(path: Path) -> list[str]:
    """Link targets in ``path`` that are neither URLs nor in-page anchors (code is skipped)."""
    text = CODE_SPAN.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http:, https:, mailto: ...; or an anchor in the same page
        out.append(target)
    return out


def test_readme_is_short() -> None:
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; keep it to {README_MAX_LINES} (details go in docs/)"


def test_readme_keeps_results_markers() -> None:
    text = README.read_text(encoding="utf-8")
    begin, end = text.find("<!-- results:begin -->"), text.find("<!-- results:end -->")
    assert 0 <= begin < end, "README.md needs <!-- results:begin --> ... <!-- results:end --> (speculant bench-report)"


def test_docs_pages_exist() -> None:
    for name in ("index", "methods", "performance", "heads", "architecture"):
        assert (DOCS / f"{name}.md").is_file(), f"docs/{name}.md is missing"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(path: Path) -> None:
    broken = []
    for target in relative_links(path):
        file_part = unquote(target.split("#", 1)[0])
        if not file_part:
            continue
        if not (path.parent / file_part).exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: links to missing files: {broken}"


def test_docs_links_stay_inside_docs() -> None:
    """The site is built from docs/ alone: a docs page linking out of it would be dead on the site."""
    outside = {}
    for path in sorted(DOCS.glob("*.md")):
        bad = [t for t in relative_links(path)
               if not (path.parent / unquote(t.split("#", 1)[0])).resolve().is_relative_to(DOCS.resolve())]
        if bad:
            outside[path.name] = bad
    assert not outside, f"docs pages linking outside docs/ (use a code span for repository paths): {outside}"


def test_link_finder(tmp_path: Path) -> None:
    md = ("[a](docs/x.md) ![i](img.png) [u](https://e.org) [s](#top) [t](y.md#part \"title\")\n"
          "`[c](not-a-link.md)`\n```\n[d](in-a-fence.md)\n```\n")
    p = tmp_path / "probe.md"
    p.write_text(md, encoding="utf-8")
    assert relative_links(p) == ["docs/x.md", "img.png", "y.md#part"]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs-material is not installed (it comes with `make install`, or "
                    "`pip install -e '.[docs]'`)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()
    for page in ("methods", "performance", "heads", "architecture"):
        assert (tmp_path / "site" / page / "index.html").is_file(), f"the site has no {page} page"


def test_every_design_note_the_code_points_to_exists():
    """Source comments point into docs/design-notes.md by anchor; each anchor must be a section."""
    notes = (ROOT / "docs" / "design-notes.md").read_text("utf-8")
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", notes, flags=re.M)}
    cited = set()
    for path in [*(ROOT / "src").rglob("*"), *(ROOT / "tools").rglob("*")]:
        if path.is_file() and path.suffix in (".py", ".cpp", ".h", ".sh"):
            cited |= {(path.name, a) for a in re.findall(r"design-notes\.md#([a-z0-9-]+)", path.read_text("utf-8"))}
    assert cited, "no pointers found: the search is broken"
    missing = sorted(f"{name}: #{a}" for name, a in cited if a not in anchors)
    assert not missing, f"pointers to sections docs/design-notes.md lacks: {missing}"


def test_readme_method_table_lists_every_method_of_the_cli():
    """The README's table of methods has one row for each --method the CLI takes, no more."""
    from speculant.config import METHODS

    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| `--method` |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(re.match(r"\| `([a-z0-9+]+)`", line).group(1))
    assert sorted(rows) == sorted(METHODS)


def test_docs_index_lists_every_page_and_method():
    """docs/index.md links every page of the site and names every --method."""
    from speculant.config import METHODS

    text = (DOCS / "index.md").read_text()
    for page in sorted(DOCS.glob("*.md")):
        if page.name != "index.md":
            assert f"]({page.name})" in text, page.name
    methods = text[text.index("[Methods](methods.md)"):].split("\n- ")[0]
    assert all(f"`{m}`" in methods for m in METHODS)


def _cli_choices() -> tuple[list[str], dict[str, dict[str, set[str]]]]:
    """The CLI's subcommands, in order, and each one's options that take a fixed set of values:
    {command: {"--option": {choices}}}, from the parser itself."""
    import argparse

    from speculant.cli.commands import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    choices = {name: {opt: {str(c) for c in a.choices} for a in parser._actions if a.choices for opt in a.option_strings}
               for name, parser in sub.choices.items()}
    return list(sub.choices), choices


# `--option {a,b,c}` (argparse's own form) or `--option a|b|c`, in a table or a synopsis
DOC_CHOICES = re.compile(r"(--[a-z][a-z0-9-]*) (?:\{([a-z0-9.+,-]+)\}|([a-z0-9.+-]+(?:\|[a-z0-9.+-]+)+))")


def test_cli_page_lists_the_parsers_own_choices():
    """docs/cli.md's command list is the parser's subcommands, and every list of values it gives an
    option (``--method {auto,ar,...}``, ``--dtype bfloat16|float32``) is that command's choices."""
    commands, choices = _cli_choices()
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    listed = re.search(r"^speculant \{([a-z,-]+)\} \.\.\.$", text, flags=re.M)
    assert listed, "docs/cli.md no longer opens with `speculant {command,...} ...`"
    assert sorted(listed.group(1).split(",")) == sorted(commands)
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    checked, wrong = 0, []
    for section in sections:
        name = section.split("\n", 1)[0].strip()
        if name not in choices:
            continue
        for option, braces, bars in DOC_CHOICES.findall(section):
            documented = set((braces or bars).split("," if braces else "|"))
            actual = choices[name].get(option)
            checked += 1
            if documented != actual:
                wrong.append(f"{name} {option}: the page lists {sorted(documented)}, the parser takes "
                             f"{sorted(actual) if actual else 'any value'}")
    assert checked >= 10, f"only {checked} option lists found in docs/cli.md: the search is broken"
    assert not wrong, "docs/cli.md's option values differ from the CLI's:\n" + "\n".join(wrong)
