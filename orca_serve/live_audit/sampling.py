"""Which requests are audited: a uniform random sample of the traffic.

Each orca request is picked with probability `rate` by a server-side RNG that sees nothing of
the request, so the audited requests are a uniform random sample; a picked request runs with
the probe in shadow (the client gets the full-budget answer) and in record mode.
"""

from __future__ import annotations

import random


class AuditSampler:
    """Bernoulli(rate) per request from a private RNG: the decision depends on nothing but the RNG
    (not the prompt, the delta, the time or the load), so audits are a uniform sample."""

    def __init__(self, rate: float, seed: int | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"audit rate must be in [0, 1], got {rate}")
        self.rate = rate
        self._rng = random.Random(seed)

    def pick(self) -> bool:
        return self.rate > 0 and self._rng.random() < self.rate
