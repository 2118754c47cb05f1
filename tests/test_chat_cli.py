"""``speculant chat`` under a real terminal (a pseudo-terminal the process has as its controlling
terminal, so Ctrl-C is the terminal's SIGINT) and with piped input, on a tiny model whose
word tokenizer carries a chat template: each message renders as ``ROLE: CONTENT`` and the prompt
ends with ``assistant:``, so a conversation's prompt tokens are one per role and one per word.
Greedy answers of the tiny model are gibberish but deterministic. The three chat processes start
together (most of their time is loading Python and torch)."""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from tiny import tiny_model_dir, word_tokenizer

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
SRC = str(Path(__file__).resolve().parent.parent / "src")
ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[=>()][0-9A-Za-z]?)")
SUMMARY = re.compile(r"\[(\d+) tokens, \S+ tokens/s, τ \S+ tokens/pass([^\]]*)\]")
GREEN = "\x1b[32m"
TIMEOUT = 180  # seconds for any one expected output: the machine may be busy


def chat_argv(model: str, *extra: str) -> list[str]:
    """The chat on ``model`` drafting by itself (every draft token accepted), greedy, float32."""
    return [sys.executable, "-m", "speculant.cli", "chat", "--target", model, "--draft", model, "--method", "sd",
            "--gamma", "3", "--no-pacing", "--dtype", "float32", *extra]


def chat_env(cache: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               SPECULANT_CACHE=str(cache), OMP_NUM_THREADS="1", TERM="xterm-256color", COLUMNS="200")
    env.pop("NO_COLOR", None)
    return env


def _take_terminal() -> None:
    """In the child, after setsid: make its standard input (the pty) its controlling terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """A process on a pseudo-terminal: ``send`` types, ``expect`` reads until a pattern shows."""

    def __init__(self, argv: list[str], env: dict):
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     start_new_session=True, preexec_fn=_take_terminal)
        os.close(slave)
        self.fd, self.raw, self.pos = master, b"", 0

    @property
    def text(self) -> str:
        """Everything shown so far, escape sequences and carriage returns removed."""
        text = self.raw.decode("utf-8", "replace")
        text = re.sub(r"\x1b[^a-zA-Z]*$", "", text)  # an escape sequence still arriving
        return ANSI.sub("", text).replace("\r", "")

    def _read(self, deadline: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], max(0.0, min(1.0, deadline - time.monotonic())))
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:  # the process closed the terminal
            chunk = b""
        self.raw += chunk
        return bool(chunk)

    def expect(self, pattern: str) -> re.Match:
        """The first match of ``pattern`` in the text after the previous match; read until it shows."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            m = re.compile(pattern).search(self.text, self.pos)
            if m:
                self.pos = m.end()
                return m
            alive = self._read(deadline)
            assert alive and time.monotonic() < deadline, f"no {pattern!r} in the output:\n{self.text[self.pos:]}"

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def turn(self, message: str) -> tuple[str, re.Match]:
        """Send one line and wait for its answer: (the answer's text, its summary line's match)."""
        self.send(message + "\n")
        self.expect(re.escape(message) + r"\n")  # the terminal's echo
        start = self.pos
        summary = self.expect(SUMMARY.pattern)
        answer = self.text[start:summary.start()].strip()
        self.expect(">>> ")
        return answer, summary

    def prompt_tokens(self) -> int:
        """The last answer's prompt tokens, as /stats gives them."""
        self.send("/stats\n")
        n = int(self.expect(r"last answer: .*; prompt (\d+) tokens").group(1))
        self.expect(r"session: .*\n")
        self.expect(">>> ")
        return n

    def wait(self) -> int:
        deadline = time.monotonic() + TIMEOUT
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(deadline)
        return self.proc.wait(5)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.fd)


PIPED = 'w1 w2 w3\n/stats\n\nw1 w2 w3\n"""\nw4\nw5\n"""\n/nonsense\n'


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """The model, and the three chat processes started at once: ``main`` (8-token answers),
    ``long`` (480-token answers, to be stopped by Ctrl-C) and ``piped`` (PIPED on standard input)."""
    root = tmp_path_factory.mktemp("chat")
    model = tiny_model_dir(root / "model", seed=0)
    tok = word_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(model)
    env = chat_env(root / "cache")
    piped = subprocess.Popen(chat_argv(str(model), "--max-new-tokens", "8"), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    main = Terminal(chat_argv(str(model), "--max-new-tokens", "8"), env)
    long = Terminal(chat_argv(str(model), "--max-new-tokens", "480"), env)
    yield {"main": main, "long": long, "piped": piped}
    for term in (main, long):
        term.close()
    if piped.poll() is None:
        piped.kill()
    piped.wait()


def test_a_conversation_on_a_terminal(chats):
    t = chats["main"]
    t.expect("green = accepted draft tokens")
    assert GREEN in t.raw.decode()  # the legend is coloured
    t.expect(">>> ")
    first, summary = t.turn("w1 w2 w3")
    assert summary.group(1) == "8" and "cut at --max-new-tokens 8" in summary.group(2)
    assert re.fullmatch(r"(w\d+ ?)+", first), first
    p1 = t.prompt_tokens()
    assert p1 == 5  # "user:", three words, "assistant:"

    shown = len(t.raw)
    second, _ = t.turn("w1 w2 w3")
    assert GREEN in t.raw[shown:].decode("utf-8", "replace")  # accepted draft tokens are coloured
    # the history went with it: the first user turn, the first answer, then this turn
    assert t.prompt_tokens() == 4 + 1 + len(first.split()) + 4 + 1

    t.send("/reset\n")
    t.expect(r"conversation was cleared")
    t.expect(">>> ")
    again, _ = t.turn("w1 w2 w3")
    assert again == first and t.prompt_tokens() == p1  # as the first turn: nothing else was sent

    t.send("/system w9 w9\n")
    t.expect(r"system prompt set; the conversation was cleared")
    t.expect(">>> ")
    t.turn("w1 w2 w3")
    assert t.prompt_tokens() == p1 + 3  # "system:", two words

    t.send("/system\n")
    t.expect(r"system prompt removed")
    t.expect(">>> ")
    for line in ('"""', "w1 w2", "w3"):  # one message of two lines: the same tokens as "w1 w2 w3"
        t.send(line + "\n")
        t.expect(r"\.\.\. ")
    block, _ = t.turn('"""')
    assert block == first and t.prompt_tokens() == p1

    t.send("/help\n")
    t.expect(r"/reset .*\n(.*\n)*.*/exit")
    t.expect(">>> ")
    t.send("/exit\n")
    assert t.wait() == 0


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(chats):
    t = chats["long"]
    t.expect(">>> ")
    t.send("w1 w2 w3\n")
    t.expect(r"w1 w2 w3\n")
    t.expect(r"w\d+ w\d+")  # the answer is streaming
    t.send("\x03")
    summary = t.expect(SUMMARY.pattern)
    assert "stopped by Ctrl-C" in summary.group(2) and int(summary.group(1)) < 480
    t.expect(">>> ")
    t.send("/stats\n")
    t.expect(r"finish reason cancelled")
    t.expect(r"conversation 2 messages")  # the partial answer stays
    t.expect(">>> ")
    assert t.proc.poll() is None

    t.send("w7 w8")  # typed, not sent: Ctrl-C clears it, a second one quits
    t.expect("w7 w8")
    t.send("\x03")
    t.expect(r"line was cleared")
    t.expect(">>> ")
    t.send("\x03")
    assert t.wait() == 0


def test_piped_input_is_one_turn_a_line_without_colour(chats):
    out, err = chats["piped"].communicate(PIPED, timeout=TIMEOUT)
    assert chats["piped"].returncode == 0, err
    assert "\x1b" not in out and ">>>" not in out
    lines = out.splitlines()
    answer, stats, session, second, block, unknown = lines
    assert re.fullmatch(r"(w\d+ ?)+", answer) and "prompt 5 tokens" in stats and "1 answer," in session
    assert second != "" and block != ""
    assert unknown.startswith("unknown command /nonsense")
    assert len(SUMMARY.findall(err)) == 3  # one summary per answer, on standard error
