"""Text a model is given (a prompt, chat messages and their system prompt, stop strings) must be
valid Unicode without NUL characters. :func:`text_problem` says what is wrong and where (or
nothing); :func:`check_text` raises it as a ConfigError. The Python API, the CLI and the server
check every such text with them."""

from __future__ import annotations

import re

from .errors import ConfigError

_BAD = re.compile("[\x00\ud800-\udfff]")  # NUL, or a UTF-16 surrogate (never a character of its own)


def text_problem(text: str) -> str | None:
    """What makes ``text`` unusable as model input, as the end of a sentence about it ("has a
    lone surrogate U+D800 at character 0: ..."); None when it is valid Unicode text without NUL."""
    found = _BAD.search(text)
    if found is None:
        return None
    i, c = found.start(), ord(found.group())
    if c == 0:
        return f"has a NUL character (U+0000) at character {i}: remove it (models take text, not binary data)"
    nxt = ord(text[i + 1]) if i + 1 < len(text) else 0
    if 0xD800 <= c <= 0xDBFF and 0xDC00 <= nxt <= 0xDFFF:
        char = 0x10000 + ((c - 0xD800) << 10) + (nxt - 0xDC00)
        return (f"has the UTF-16 surrogate pair U+{c:04X} U+{nxt:04X} at character {i}: give valid Unicode text "
                f"(the character U+{char:04X} itself, not its two UTF-16 halves)")
    hint = f" (the byte 0x{c - 0xDC00:02X}, which is not UTF-8)" if 0xDC80 <= c <= 0xDCFF else ""
    return (f"has a lone surrogate U+{c:04X} at character {i}{hint}: give valid Unicode text (a \\uXXXX escape "
            "of a surrogate must be one of a high-low pair)")


def check_text(text: str, what: str = "the prompt") -> str:
    """``text`` itself if it is valid Unicode text without NUL; else a ConfigError that names
    ``what`` (e.g. "the prompt", "messages[0] (system) content"), the character and its index."""
    if not isinstance(text, str):
        raise ConfigError(f"{what} must be a string, got {type(text).__name__}")
    problem = text_problem(text)
    if problem:
        raise ConfigError(f"{what} {problem}")
    return text
