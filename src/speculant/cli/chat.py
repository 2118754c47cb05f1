"""``speculant chat``: an interactive chat in the terminal over the public API.

Every turn sends the whole conversation (system prompt, every user and assistant message so far)
to ``SpeculativeDecoder.start`` as chat messages, so a prefix cache under the decoder finds the
history already computed. On a terminal the answer streams with the accepted draft tokens in
green; Ctrl-C during an answer asks the generation to stop after its current step (``cancel=``),
and the partial answer stays in the history. Piped input: each line is a turn, the answers go to
standard output without colour and the per-answer summaries to standard error.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Callable

from ..errors import ConfigError, SpeculantError

PROMPT, MORE = ">>> ", "... "
BLOCK = '"""'  # opens and closes a multi-line message
DRAFT_STYLE = "green"

HELP = f"""commands:
  /help           this list
  /reset          forget the conversation (the system prompt stays)
  /system TEXT    set the system prompt and forget the conversation; /system alone removes it
  /stats          the last answer's and the session's numbers
  /exit           quit (also /quit, /bye, Ctrl-D)
multi-line message: a line starting with {BLOCK} opens it, a line ending with {BLOCK} closes it
  (text starting with "/" that is not a command can be sent the same way)
Ctrl-C during an answer stops it (what was written stays in the conversation); at the prompt it
  clears the line, and a second Ctrl-C in a row quits"""


def add_chat_options(p: argparse.ArgumentParser) -> None:
    """The options of ``chat`` beside the decoder's and sampling's (``commands``)."""
    p.add_argument("--system", default=None, metavar="TEXT", help="the system prompt (default: none)")
    p.add_argument("--no-color", action="store_true", help="no colours, even on a terminal")
    p.set_defaults(max_new_tokens=512)


def cmd_chat(args) -> int:
    from ..config import SamplingConfig
    from ..text_check import check_text
    from .commands import _decoder

    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)  # fails before any model loads
    if args.system is not None:
        check_text(args.system, "--system")
    interactive = sys.stdin.isatty()
    screen = Screen(color=interactive and sys.stdout.isatty() and not args.no_color, interactive=interactive)
    args.chat = True
    decoder = _decoder(args)
    if not getattr(decoder.tokenizer, "chat_template", None):
        raise ConfigError(f"{decoder.target.name} has no chat template, so it cannot chat: use a chat (instruct) "
                          "model, or `speculant generate` to continue a plain text prompt")
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    chat = Chat(decoder, screen, args.system or None, args.max_new_tokens, sampling)
    if interactive:
        import_readline()
        chat.banner()
    try:
        return chat.loop(line_reader(interactive))
    except KeyboardInterrupt:  # a second Ctrl-C while an answer was stopping
        screen.newline()
        print("speculant: interrupted", file=sys.stderr)
        return 130


class Screen:
    """Where the chat writes: the answer as it streams (draft tokens styled when ``color``),
    notes (standard output on a terminal, standard error when the input is piped) and replies
    to commands."""

    def __init__(self, color: bool, interactive: bool):
        self.color, self.interactive = color, interactive
        self.console = None
        if color:
            from rich.console import Console

            self.console = Console(highlight=False)

    def piece(self, text: str, style: str | None = None) -> None:
        if not text:
            return
        if self.console is not None:
            self.console.print(text, end="", style=style, markup=False, soft_wrap=True)
        else:
            sys.stdout.write(text)
            sys.stdout.flush()

    def newline(self) -> None:
        self.piece("\n")

    def say(self, text: str) -> None:
        """A reply to a command (standard output)."""
        self.piece(text + "\n")

    def note(self, text: str) -> None:
        """A summary or a hint: dim on a terminal, standard error when the input is piped."""
        if self.interactive:
            self.piece(text + "\n", "dim")
        else:
            print(text, file=sys.stderr, flush=True)


class Chat:
    """One conversation with ``decoder``: the history, the last answer and the session's totals."""

    def __init__(self, decoder, screen: Screen, system: str | None, max_new_tokens: int, sampling: dict):
        self.decoder, self.screen, self.system = decoder, screen, system
        self.max_new_tokens, self.sampling = max_new_tokens, sampling
        self.history: list[dict] = []  # user and assistant messages, oldest first
        self.last = None  # the last answer's Generation
        self.answers = self.tokens = self.passes = 0
        self.seconds = 0.0

    def messages(self) -> list[dict]:
        """What the next turn sends before the user's message: the system prompt and the history."""
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def banner(self) -> None:
        d = self.decoder
        self.screen.say(f"speculant chat: {d.target.name}, method {d.method}. /help for commands, {BLOCK} for a "
                        "multi-line message, Ctrl-D or /exit to quit.")
        if self.screen.color and d.config.spec.drafts:
            self.screen.piece("green", DRAFT_STYLE)
            self.screen.note(" = accepted draft tokens (verified by the target), plain = the target's own tokens")

    # ---- the prompt loop ------------------------------------------------------------------
    def loop(self, read: Callable[[str], str]) -> int:
        """Read messages and commands until /exit, the end of input or two Ctrl-C in a row; the exit status."""
        interrupted = False
        while True:
            try:
                text = read_message(read)
            except EOFError:  # Ctrl-D, or the end of piped input
                if self.screen.interactive:
                    self.screen.newline()
                return 0
            except KeyboardInterrupt:  # at the prompt: the line is dropped; twice in a row quits
                self.screen.newline()
                if interrupted:
                    return 0
                interrupted = True
                self.screen.note("(the line was cleared; Ctrl-C again, Ctrl-D or /exit quits)")
                continue
            interrupted = False
            if not text.strip():
                continue
            if text.startswith("/") and "\n" not in text:
                if self.command(text.strip()) == "exit":
                    return 0
            else:
                self.answer(text)

    def command(self, line: str) -> str | None:
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name in ("/exit", "/quit", "/bye"):
            return "exit"
        if name == "/help":
            self.screen.say(HELP)
        elif name in ("/reset", "/clear"):
            self.history = []
            self.screen.say("(the conversation was cleared)")
        elif name == "/system":
            if rest:
                try:
                    from ..text_check import check_text

                    check_text(rest, "the system prompt")
                except SpeculantError as e:
                    self.screen.say(f"error: {e}")
                    return None
            self.system, self.history = rest or None, []
            self.screen.say("(system prompt set; the conversation was cleared)" if rest else
                            "(system prompt removed; the conversation was cleared)")
        elif name == "/stats":
            self.screen.say(self.stats_text())
        else:
            self.screen.say(f"unknown command {name}: /help lists the commands (to send text that starts with "
                            f"'/', put it in a {BLOCK} block)")
        return None

    # ---- one answer -------------------------------------------------------------------------
    def answer(self, text: str) -> None:
        """Stream the answer to ``text``; the turn joins the history unless it failed or wrote nothing."""
        message = {"role": "user", "content": text}
        stop = StopOnCtrlC()
        try:
            gen = self.decoder.start(self.messages() + [message], self.max_new_tokens, cancel=stop.requested,
                                     **self.sampling)
            with stop:
                for event in gen:
                    self.screen.piece(event.text, DRAFT_STYLE if event.source == "draft" and self.screen.color
                                      else None)
                self.screen.piece(gen.text[len(gen.shown):])  # text held back to the end, if any
        except SpeculantError as e:
            self.screen.newline()
            hint = " (/reset starts a new conversation)" if self.history else ""
            self.screen.say(f"error: {e}{hint}")
            return
        self.screen.newline()
        self.last = gen
        s = gen.stats
        if s is not None:
            self.answers, self.tokens, self.passes = self.answers + 1, self.tokens + s.new_tokens, \
                self.passes + s.target_calls
            self.seconds += s.wall_s
        if gen.token_ids:
            self.history += [message, {"role": "assistant", "content": gen.text}]
        self.screen.note(self.summary(gen))
        if self.screen.interactive:
            self.screen.newline()

    def summary(self, gen) -> str:
        """One line after an answer: tokens, tokens/s, τ, and why it ended if it did not end by itself."""
        s = gen.stats
        n, passes, wall = (s.new_tokens, s.target_calls, s.wall_s) if s is not None else (0, 0, 0.0)
        line = f"[{n} tokens, {rate(n, wall)} tokens/s, τ {ratio(n, passes)} tokens/pass"
        if gen.finish_reason == "cancelled":
            line += "; stopped by Ctrl-C"
        elif gen.finish_reason == "length":
            line += (f"; cut at --max-new-tokens {self.max_new_tokens}" if n >= self.max_new_tokens else
                     "; the model's context is full: /reset starts a new conversation")
        return line + "]"

    def stats_text(self) -> str:
        lines = []
        gen = self.last
        if gen is None:
            lines.append("last answer: none yet")
        else:
            s = gen.stats
            n, passes, wall = (s.new_tokens, s.target_calls, s.wall_s) if s is not None else (0, 0, 0.0)
            alpha = f", α {s.acceptance_rate:.2f}" if s is not None and self.decoder.config.spec.drafts else ""
            cached = cached_tokens(gen)
            cached = f" ({cached} of them cached)" if cached is not None else ""
            lines.append(f"last answer: {n} tokens in {wall:.2f} s, {rate(n, wall)} tokens/s; {passes} target "
                         f"passes, τ {ratio(n, passes)} tokens/pass{alpha}; prompt {gen.prompt_tokens} "
                         f"tokens{cached}; finish reason {gen.finish_reason}")
        lines.append(f"session: {plural(self.answers, 'answer')}, {self.tokens} tokens in {self.seconds:.2f} s, "
                     f"{rate(self.tokens, self.seconds)} tokens/s; {self.passes} target passes, "
                     f"τ {ratio(self.tokens, self.passes)} tokens/pass; "
                     f"conversation {plural(len(self.history), 'message')}"
                     + ("; system prompt set" if self.system else ""))
        return "\n".join(lines)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def rate(n: int, seconds: float) -> str:
    return f"{n / seconds:.1f}" if seconds > 0 else "-"


def ratio(n: int, passes: int) -> str:
    return f"{n / passes:.2f}" if passes else "-"


def cached_tokens(gen) -> int | None:
    """The prompt tokens a prefix cache supplied, where the generation or its stats report them."""
    for source in (gen, gen.stats):
        value = getattr(source, "cached_tokens", None)
        if isinstance(value, int):
            return value
    return None


class StopOnCtrlC:
    """While active (``with``): the first Ctrl-C asks the generation to stop (``requested``, its
    ``cancel``), a second one raises KeyboardInterrupt as usual."""

    def __init__(self):
        self.stop = False
        self._before = None

    def requested(self) -> bool:
        return self.stop

    def _on_sigint(self, signum, frame) -> None:
        if self.stop:
            raise KeyboardInterrupt
        self.stop = True

    def __enter__(self):
        self._before = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._before)


def read_message(read: Callable[[str], str]) -> str:
    """One message: a line, or the lines of a {BLOCK} block joined by newlines (text after the
    opening and before the closing quotes included; the end of input closes an open block)."""
    line = read(PROMPT)
    if not line.lstrip().startswith(BLOCK):
        return line
    body = line.lstrip()[len(BLOCK):]
    if body.rstrip().endswith(BLOCK):  # """one line"""
        return body.rstrip()[:-len(BLOCK)]
    lines = [body] if body.strip() else []
    while True:
        try:
            line = read(MORE)
        except EOFError:
            break
        if line.rstrip().endswith(BLOCK):
            last = line.rstrip()[:-len(BLOCK)]
            if last.strip():
                lines.append(last)
            break
        lines.append(line)
    return "\n".join(lines)


def line_reader(interactive: bool) -> Callable[[str], str]:
    """``read(prompt)``: the next line without its newline (EOFError at the end); the prompt shows
    on a terminal only."""
    if interactive:
        return input

    def read(prompt: str) -> str:
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")
    return read


def import_readline() -> None:
    """Line editing and an input history at the prompt, where Python has readline."""
    try:
        import readline  # noqa: F401 (input() uses it once imported)
    except ImportError:
        pass
