"""The never-stop and never-give-up thresholds, defined once, and their JSON form.

LTT certifies lambda*(delta) or nothing; "nothing" means the deployed procedure never stops early
(no smoothed score in [0, 1] reaches an infinite threshold). Every never-stop threshold in the
code is `NEVER`; JSON (bundles, results, audit tables) has no infinity and writes null, and the
`orca_lam` xarg writes "inf" (`orca_serve.settings.xargs.encode_lam`).
"""

from __future__ import annotations

import math

NEVER = math.inf
# the longest name a threshold group may have: a bundle's `groups` keys and a request's
# `orca.group` (docs/METHOD.md section 12)
GROUP_NAME_MAX = 64
GIVE_UP_NEVER = -math.inf  # the never-give-up threshold mu (no score in [0, 1] is <= -inf)
# the longest smoothing window a bundle may fix: the server keeps window floats per request row
MAX_WINDOW = 10_000


def lam_to_json(lam: float | None) -> float | None:
    """A threshold as JSON: NEVER (or no threshold at all) becomes null."""
    return None if lam is None or math.isinf(lam) else float(lam)


def lam_from_json(v: float | None) -> float:
    """A JSON threshold: null is NEVER."""
    return NEVER if v is None else float(v)


def mu_from_json(v: float | None) -> float:
    """A JSON give-up threshold: null is GIVE_UP_NEVER (`lam_to_json` writes both kinds)."""
    return GIVE_UP_NEVER if v is None else float(v)
