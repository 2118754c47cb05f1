"""Write ``src/speculant/data/sessions.jsonl``, the multi-turn sessions of ``speculant bench --sessions``.

Usage: ``python tools/make_sessions.py [--out FILE] [--commit REV]`` (needs the ``chitchat-dataset``
package of requirements-data.txt and a git checkout). The output is the same on every run: each
session's text comes from a fixed source, listed in ``src/speculant/data/NOTICE.md``:

- ``coding-grammars``: speculant's own ``src/speculant/grammars.py`` at ``--commit`` (default
  ``SOURCE_COMMIT``) in the system prompt, read with ``git show`` so later edits of the module do
  not change the session, and five questions about it written for this file;
- ``chat-movies``, ``chat-music``: the first six user turns (the first speaker's messages) of two
  Chit Chat Challenge dialogues (``chitchat-dataset==0.9.0``, MIT), chosen among those that pass
  ``chat_ok`` (printed: how many pass);
- ``mt-bench-<id>``: four two-turn MT-bench questions of Spec-Bench (``spec_bench_questions.jsonl``);
- ``agent-textstats``: an agent system prompt, five OpenAI function tools and five follow-up user
  turns, all written for this file.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "src" / "speculant" / "data" / "sessions.jsonl"
SOURCE_COMMIT = "004574f0f33d3ee793a6198fb88f0b0753a4910c"
CODING_FILE = "src/speculant/grammars.py"
OWN = "Apache-2.0 (speculant's licence)"
CHITCHAT = "MIT (chitchat-dataset 0.9.0: Copyright (c) 2019 Perception, Control and Cognition Lab)"
CHAT_PICKS = {"chat-movies": "980d5241-b879-44ab-aedb-748ebca59a83",
              "chat-music": "84303a08-6273-4ba6-a00c-72c4af110d3b"}
MT_BENCH_IDS = (81, 101, 121, 131)  # writing, reasoning, coding, extraction
CHAT_TURNS = 6

CODING_SYSTEM = ("You are a senior Python developer reviewing code with a colleague. The colleague has this "
                 "file open in the editor; answer questions about it concisely and quote the lines you refer "
                 "to.\n\nFile: {path}\n```python\n{text}```")
CODING_TURNS = (
    "What does a Matcher have to support, and why must `advance` leave the state unchanged when it refuses a token?",
    "Explain the bitmask layout. For a vocabulary of 151,936 tokens, how many int32 words does a row have, and "
    "which word and which bit hold token 100,000?",
    "In `_XGrammarMatcher.ended`, what is `~(bit - (1 << 32) if bit >= 1 << 31 else bit)` for? Rewrite that line "
    "so it is easier to read.",
    "Add a third engine name, `outlines`, to `make_engine` that raises a clear ConfigError saying it is not "
    "supported yet. Show the changed function only.",
    "Write pytest tests for `GrammarSpec` and `mask_words` that run without llguidance or xgrammar installed.",
)

AGENT_SYSTEM = (
    "You are a coding agent working in the user's repository, a small Python package called textstats. You "
    "can read and write files, list directories, search the code and run shell commands through the tools "
    "you are given. Work in small steps: look before you change anything, change as little as you can, and "
    "run the tests after every change. Never invent a file's contents: read it first. When a tool is the "
    "next step, call it; when you have an answer, give it in a few sentences and show code as a unified "
    "diff or a complete function. The repository's layout: textstats/ (counting.py, cli.py, report.py, "
    "__init__.py), tests/ (test_counting.py, test_cli.py), pyproject.toml. Python 3.11, pytest for the "
    "tests, no network access.")


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


AGENT_TOOLS = [
    _tool("read_file", "Read a text file of the repository, whole or a range of its lines.",
          {"path": {"type": "string", "description": "path relative to the repository root"},
           "start_line": {"type": "integer", "description": "first line to return, from 1"},
           "end_line": {"type": "integer", "description": "last line to return (inclusive)"}}, ["path"]),
    _tool("write_file", "Create or replace a file of the repository with the given content.",
          {"path": {"type": "string", "description": "path relative to the repository root"},
           "content": {"type": "string", "description": "the file's complete new text"}}, ["path", "content"]),
    _tool("list_directory", "List the files and directories in a directory of the repository.",
          {"path": {"type": "string", "description": "directory relative to the repository root; '.' for the root"}},
          ["path"]),
    _tool("search_code", "Search the repository's files for a regular expression; returns path:line: text "
                         "for every match.",
          {"pattern": {"type": "string", "description": "a Python regular expression"},
           "glob": {"type": "string", "description": "only files matching this glob, e.g. '*.py'"}}, ["pattern"]),
    _tool("run_shell", "Run a shell command in the repository root and return its exit status and output.",
          {"command": {"type": "string", "description": "the command line, e.g. 'pytest -q tests'"},
           "timeout_s": {"type": "integer", "description": "seconds before the command is stopped (default 60)"}},
          ["command"]),
]

AGENT_TURNS = (
    "CI started failing after I refactored textstats/counting.py: `pytest -q` reports that "
    "tests/test_counting.py::test_top_words_breaks_ties_alphabetically fails. Find out why and fix it.",
    "Here is what read_file gave for textstats/counting.py:\n```python\nfrom collections import Counter\n"
    "import re\n\nWORD = re.compile(r\"[a-z']+\")\n\n\ndef words(text: str) -> list[str]:\n"
    "    return WORD.findall(text.lower())\n\n\ndef top_words(text: str, n: int = 5) -> list[tuple[str, int]]:\n"
    "    \"\"\"The n most frequent words and their counts, most frequent first; ties in alphabetical order.\"\"\"\n"
    "    counts = Counter(words(text))\n    return counts.most_common(n)\n```\nWhat is wrong with the tie handling?",
    "I ran `pytest -q tests/test_counting.py` with run_shell:\n```\n.F.\n=================================== FAILURES "
    "===================================\n___________________ test_top_words_breaks_ties_alphabetically "
    "___________________\n    def test_top_words_breaks_ties_alphabetically():\n>       assert top_words(\"b a c b a c "
    "d\", 3) == [(\"a\", 2), (\"b\", 2), (\"c\", 2)]\nE       AssertionError: assert [('b', 2), ('a', 2), ('c', 2)] == "
    "[('a', 2), ('b', 2), ('c', 2)]\n1 failed, 2 passed in 0.04s\n```\nDoes that confirm it? Write the fix with "
    "write_file.",
    "The fix is in and the test passes. search_code for `top_words\\(` found two more callers:\n```\n"
    "textstats/cli.py:41:    for word, count in top_words(text, args.n):\ntextstats/report.py:88:    leaders = "
    "[w for w, _ in top_words(body, 3)]\n```\nCould either of them depend on the old order of ties?",
    "Good. Add a regression test with three words of equal count and one more frequent word, then tell me the "
    "command that runs the whole suite.",
)


def coding_session(commit: str) -> dict:
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{CODING_FILE}"], capture_output=True,
                          text=True, check=True).stdout
    return {"id": "coding-grammars", "kind": "coding",
            "system": CODING_SYSTEM.format(path=CODING_FILE, text=text), "tools": None,
            "turns": list(CODING_TURNS),
            "source": f"speculant {CODING_FILE} at commit {commit}; questions written for this file",
            "licence": OWN}


def chat_ok(users: list[str]) -> bool:
    """A dialogue's first ``CHAT_TURNS`` user turns make a chat session: every one 5 to 60 words of
    ASCII text without a URL, an e-mail address or a long number, at least 4 of them with a question
    mark, the first at least 8 words long."""
    if len(users) < CHAT_TURNS:
        return False
    first = users[:CHAT_TURNS]
    plain = all(5 <= len(t.split()) <= 60 and t.isascii() and not re.search(r"http|www\.|@|\d{4,}", t)
                for t in first)
    return plain and sum("?" in t for t in first) >= 4 and len(first[0].split()) >= 8


def chat_sessions() -> list[dict]:
    sys.path.insert(0, str(ROOT / "src"))
    from speculant.training.conversations import chitchat_conversations

    users_of, passing = {}, 0
    for cid, turns in chitchat_conversations():
        users = [text for role, text in turns if role == "user"]
        if chat_ok(users):
            passing += 1
            users_of[cid] = users[:CHAT_TURNS]
    print(f"chitchat: {passing} dialogues pass chat_ok", file=sys.stderr)
    out = []
    for sid, cid in CHAT_PICKS.items():
        if cid not in users_of:
            raise SystemExit(f"chitchat dialogue {cid} does not pass chat_ok: is chitchat-dataset==0.9.0 installed?")
        out.append({"id": sid, "kind": "chat", "system": None, "tools": None, "turns": users_of[cid],
                    "source": f"chitchat-dataset 0.9.0 (BYU PCC lab's Chit Chat Challenge), dialogue {cid}: the "
                              f"first speaker's first {CHAT_TURNS} turns",
                    "licence": CHITCHAT})
    return out


def mt_bench_sessions() -> list[dict]:
    path = ROOT / "src" / "speculant" / "data" / "spec_bench_questions.jsonl"
    rows = {r["question_id"]: r for r in map(json.loads, path.read_text().splitlines())}
    out = []
    for qid in MT_BENCH_IDS:
        q = rows[qid]
        assert len(q["turns"]) == 2, q
        out.append({"id": f"mt-bench-{qid}", "kind": "mt_bench", "system": None, "tools": None,
                    "turns": list(q["turns"]),
                    "source": f"Spec-Bench question {qid} ({q['category']}), from MT-bench (FastChat), via "
                              "src/speculant/data/spec_bench_questions.jsonl",
                    "licence": "Apache-2.0 (Spec-Bench; FastChat's MT-bench)"})
    return out


def agent_session() -> dict:
    return {"id": "agent-textstats", "kind": "agent", "system": AGENT_SYSTEM, "tools": AGENT_TOOLS,
            "turns": list(AGENT_TURNS), "source": "written for speculant's sessions file (system prompt, tools, "
                                                  "turns; the textstats package is fictional)",
            "licence": OWN}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--commit", default=SOURCE_COMMIT, help="the commit to read the coding session's file from")
    args = ap.parse_args()
    sessions = [coding_session(args.commit), *chat_sessions(), *mt_bench_sessions(), agent_session()]
    text = "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in sessions)
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"{args.out}: {len(sessions)} sessions, {len(text.encode())} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
