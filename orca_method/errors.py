"""The one rule for turning an exception into a user-facing line.

Every refusal orca-serve and orca-calibrate show (CLI errors, HTTP 400s, worker RPC refusals)
is one line, never a traceback; library exceptions (pydantic, json, torch) often carry several,
so they are cut to their first non-empty line, or to the exception's type when they say nothing.
A refusal that quotes what it refuses quotes at most SHOWN_CHARS of it (`shown`, `cut`): a 1 MB
value in a request field must not come back as a 1 MB error body.
"""

from __future__ import annotations


def first_line(e: BaseException) -> str:
    """The first non-empty line of `e`'s message (its type name when the message is empty); a
    line that ends in a colon announces the next one, which is what it is about, so it comes
    too ("Validation error for field 'hidden_size': Input should be a valid integer")."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


SHOWN_CHARS = 100


def cut(text: str) -> str:
    """`text` when it is at most SHOWN_CHARS long, else its start and its length."""
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


def shown(value: object) -> str:
    """repr(value) for an error message, cut as `cut` cuts."""
    return cut(repr(value))
