"""What the command line prints reaches the terminal without control characters from its inputs.

Config values, file names and model names end up in tables and error lines. A value holding an ANSI
escape sequence (`\\x1b[2J` clears the screen, `\\x1b]52;...` writes the clipboard on some terminals,
`\\x1b[8m` hides what follows), a NUL byte, or a bidirectional override (text shown in another order
than it is read) reached the terminal raw. The command line prints through `Sanitized` streams: each
such character is written as its escape (`\\x1b`, `\\x00`, `\\u202e`), so it is seen and does nothing.
Newlines, tabs and carriage returns pass (the tables and the progress line use them); the harness
itself prints no escape sequences. JSON output is unchanged: `json.dumps` escapes these already.
"""

from __future__ import annotations

import sys

_KEPT = {"\t", "\n", "\r"}
_BIDI = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
_CONTROLS = [chr(c) for c in (*range(0x20), *range(0x7F, 0xA0))] + list(_BIDI) + ["\u2028", "\u2029"]
TABLE = str.maketrans({c: ascii(c)[1:-1] for c in _CONTROLS if c not in _KEPT})


def sanitize(text: str) -> str:
    """`text` with every control character but newline, tab and carriage return written as its escape."""
    return text.translate(TABLE)


class Sanitized:
    """A text stream that writes `sanitize`d text to the stream it wraps (everything else is the wrapped
    stream's: `isatty`, `fileno`, `buffer`, ...)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(sanitize(text))

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def sanitize_standard_streams() -> None:
    """Print through `Sanitized` stdout and stderr from now on (once: a wrapped stream is not wrapped again)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, Sanitized):
            setattr(sys, name, Sanitized(stream))
