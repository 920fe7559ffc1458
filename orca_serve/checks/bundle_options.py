"""What orca-serve's options ask of a bundle, one rule for start-up (orca_serve/startup/preflight.py,
before vLLM) and every hot reload (orca_serve/api_server/reload.py): a bundle that does not satisfy the
options the server runs with is refused, in one line naming the option and the fix.

The options are fixed for the server's life, so a reload to a bundle that cannot serve them would
turn every request they shape into an error (or, for the give-up policy, serve a guarantee the
bundle does not state); checked here, such a bundle never replaces the one serving.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from orca_method.bundle import BundleError
from orca_method.outcomes import GiveUpPolicy
from orca_method.shift_gate import give_up_level
from orca_serve.settings.effort import check_effort_map

if TYPE_CHECKING:
    from orca_method.bundle import Bundle


def check_options(bundle: Bundle, *, delta: float | None, give_up_delta: float | None,
                  give_up_policy: GiveUpPolicy, effort_map: Mapping[str, str | float],
                  shift_alpha: float | None = None,
                  shift_give_up_alpha: float | None = None) -> None:
    """Refuse (BundleError, one line starting with the option) a bundle lacking what the
    options name: --orca-delta's lambda*, --orca-give-up-delta's mu*, a delta of
    --orca-effort-map, a give-up threshold certified for --orca-give-up-policy, or a gate whose
    stop level (--orca-shift-alpha, else the bundle's) is above --orca-shift-give-up-alpha."""
    if shift_give_up_alpha is not None and bundle.shift_gate is not None:
        alpha = bundle.shift_gate.alpha if shift_alpha is None else shift_alpha
        try:
            give_up_level(alpha, shift_give_up_alpha)
        except ValueError as e:
            source = "the bundle" if shift_alpha is None else "--orca-shift-alpha"
            raise BundleError(f"--orca-shift-give-up-alpha {shift_give_up_alpha:g}: {e} (the "
                              f"stop side's is {source}'s {alpha:g})") from None
    if delta is not None:
        try:
            bundle.lam(delta)
        except BundleError as e:
            raise BundleError(f"--orca-delta {delta:g}: {e}") from None
    if give_up_delta is not None:  # every request gives up with it
        try:
            bundle.mu(give_up_delta)
        except BundleError as e:
            raise BundleError(f"--orca-give-up-delta {give_up_delta:g}: {e}") from None
    try:
        check_effort_map(effort_map, bundle)
    except BundleError as e:
        raise BundleError(f"--orca-effort-map: {e}") from None
    check_give_up_policy(bundle, give_up_policy)


def check_give_up_policy(bundle: Bundle, policy: GiveUpPolicy) -> None:
    """A two-sided bundle's mu* is served only under the give-up policy it was certified for.

    Each policy has its own give-up loss (orca_method.give_up.give_up_losses): under MESSAGE a
    given-up request answers nothing, and GUESS's loss does not bound that cost (docs/METHOD.md
    section 9, "The guarantee per give-up policy"); the other way round the guarantee holds but
    the bundle's table, and what the live audit and `audit-report` measure, are another policy's.
    A one-sided bundle never gives up: any policy."""
    if bundle.give_up is None or bundle.give_up.policy == policy:
        return
    certified = bundle.give_up.policy
    raise BundleError(f"--orca-give-up-policy {policy}: the bundle's give-up threshold mu* was "
                      f"certified for give-up policy '{certified}', not '{policy}', and each has "
                      f"its own give-up loss (docs/METHOD.md section 9); serve it with "
                      f"--orca-give-up-policy {certified}, or recalibrate with "
                      f"calibrate.give_up.policy: {policy}")
