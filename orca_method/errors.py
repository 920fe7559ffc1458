"""The one rule for turning an exception into a user-facing line.

Every refusal orca-serve and orca-calibrate show (CLI errors, HTTP 400s, worker RPC refusals)
is one line, never a traceback; library exceptions (pydantic, json, torch) often carry several,
so they are cut to their first non-empty line, or to the exception's type when they say nothing.
"""

from __future__ import annotations


def first_line(e: BaseException) -> str:
    """The first line of `e`'s message (its type name when the message is empty)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
