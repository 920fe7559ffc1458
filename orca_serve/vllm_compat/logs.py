"""orca-serve's log lines in vLLM's log format, in every process that runs orca code.

vLLM configures logging for its `vllm` logger only (a handler on it, `propagate` off); the root
logger keeps Python's defaults, so a line logged under `orca_serve.*` below WARNING is dropped and
one at WARNING or above reaches stderr only through Python's last-resort handler, unformatted.
Reload outcomes, the audit's and the gate's alarms are INFO or WARNING lines operators must see,
in the API server and in the engine core alike, so the `orca_serve` logger takes vLLM's handlers
and level in both (`log_with_vllm`, called where each starts orca's part).
"""

from __future__ import annotations

import logging

ORCA_LOGGER = "orca_serve"
VLLM_LOGGER = "vllm"


def log_with_vllm() -> None:
    """Give the `orca_serve` logger vLLM's handlers and level (once vLLM configured logging:
    importing vLLM does). With vLLM's configuration off (VLLM_CONFIGURE_LOGGING=0) its logger has
    no handler and this does nothing: whoever configured logging decides."""
    vllm = logging.getLogger(VLLM_LOGGER)
    if not vllm.handlers:
        return
    orca = logging.getLogger(ORCA_LOGGER)
    for h in vllm.handlers:
        if h not in orca.handlers:
            orca.addHandler(h)
    orca.setLevel(vllm.level)
    orca.propagate = False
