"""orca-serve's log lines in the server's log, formatted as vLLM's own.

vLLM configures logging for its `vllm` logger only (a handler on it, `propagate` off); the root
logger keeps Python's defaults, so a line logged under `orca_serve.*` below WARNING is dropped and
one at WARNING or above reaches stderr only through Python's last-resort handler, unformatted and
only while no other handler exists anywhere up the hierarchy. Reload outcomes, alarms, fallback
and recalibration are INFO or WARNING lines operators must see, so the `orca_serve` logger gets
vLLM's handlers and level.
"""

from __future__ import annotations

import logging

ORCA_LOGGER = "orca_serve"


def log_like_vllm() -> None:
    """Give the `orca_serve` logger vLLM's handlers and level (after vLLM configured logging).

    With vLLM's logging configuration turned off (VLLM_CONFIGURE_LOGGING=0) its logger has no
    handler and this does nothing: whoever configured logging decides.
    """
    vllm = logging.getLogger("vllm")
    if not vllm.handlers:
        return
    orca = logging.getLogger(ORCA_LOGGER)
    for h in vllm.handlers:
        if h not in orca.handlers:
            orca.addHandler(h)
    orca.setLevel(vllm.level)
    orca.propagate = False
