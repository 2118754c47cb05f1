"""Stop strings: the generated text ends right before the first occurrence of any of them.

A stop string is matched on the decoded text, so it may span several tokens or fall inside one
accepted speculative block (a step can add many tokens). ``StopStrings.scan`` is incremental: each
call looks only at the region new text can complete a match in. ``safe_length`` tells a stream how
much text it may show without risking showing the start of a stop string that later completes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .errors import ConfigError
from .text_check import check_text

MAX_STOP_STRINGS = 4  # OpenAI's limit


def parse_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """``stop`` (None, one string, or a list of up to 4 non-empty strings) as a tuple."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ConfigError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ConfigError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}: drop some")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise ConfigError(f"every stop string must be a string, got {type(s).__name__}")
        if not s:
            raise ConfigError("a stop string is empty: remove it (an empty string would stop before any text)")
        check_text(s, f"stop string {i}" if len(stop) > 1 else "the stop string")
    return tuple(stop)


@dataclass(frozen=True)
class StopStrings:
    """The stop strings of one request (``parse_stop``'s result)."""
    strings: tuple[str, ...]

    @property
    def longest(self) -> int:
        return max((len(s) for s in self.strings), default=0)

    def scan(self, text: str, checked: int = 0) -> int | None:
        """The start of the earliest stop string in ``text``, or None. ``checked``: the length of a
        prefix of ``text`` already scanned without a match; only matches that end after it are
        looked for."""
        if not self.strings:
            return None
        begin = max(0, checked - self.longest + 1)
        found = [i for i in (text.find(s, begin) for s in self.strings) if i >= 0]
        return min(found) if found else None

    def safe_length(self, text: str) -> int:
        """How much of ``text`` (which holds no complete stop string) can be shown: all of it but
        the longest suffix that is a proper prefix of a stop string."""
        for k in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.strings):
                return len(text) - k
        return len(text)
