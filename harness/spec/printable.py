"""Text from inputs made printable: every control character but newline, tab and carriage return written
as its escape (`\\x1b`, `\\x00`, `\\u202e`), so an ANSI escape sequence, a NUL byte or a bidirectional
override in a config value, a file name or a lock file's holder is seen and does nothing.

The command line's standard streams translate everything they print (harness.cli.terminal); a layer
below it that writes past them (the line a wait for a card prints to the terminal, outside pytest's
capture) calls `sanitize` itself.
"""

from __future__ import annotations

_KEPT = {"\t", "\n", "\r"}
_BIDI = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
_CONTROLS = [chr(c) for c in (*range(0x20), *range(0x7F, 0xA0))] + list(_BIDI) + ["\u2028", "\u2029"]
TABLE = str.maketrans({c: ascii(c)[1:-1] for c in _CONTROLS if c not in _KEPT})


def sanitize(text: str) -> str:
    """`text` with every control character but newline, tab and carriage return written as its escape."""
    return text.translate(TABLE)
