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
from orca_method.consensus import format_waves
from orca_method.outcomes import GiveUpPolicy
from orca_serve.settings.effort import check_effort_map

if TYPE_CHECKING:
    from orca_method.bundle import Bundle


def check_options(bundle: Bundle, *, delta: float | None, give_up_delta: float | None,
                  give_up_policy: GiveUpPolicy, effort_map: Mapping[str, str | float],
                  vote_waves: tuple[int, ...] | None = None) -> None:
    """Refuse (BundleError, one line starting with the option) a bundle lacking what the
    options name: --orca-delta's lambda*, --orca-give-up-delta's mu*, a delta of
    --orca-effort-map, a give-up threshold certified for --orca-give-up-policy, or a consensus
    block certified for --orca-vote-waves."""
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
    check_vote_waves(bundle, vote_waves)


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


def check_vote_waves(bundle: Bundle, waves: tuple[int, ...] | None) -> None:
    """`orca.samples` is served only in the launch schedule its t was certified for.

    A wave that is launched only once the vote before it is unsettled changes when the group's
    samples finish, so a t certified for one schedule says nothing of another (docs/METHOD.md
    section 14, "Waves"). The operator names the schedule (`waves`, None: all at once) and the
    bundle's consensus block must carry that one; a bundle without the block serves no
    `orca.samples` at all: any schedule."""
    if bundle.consensus is None:
        return
    certified = bundle.consensus.waves
    if (None if certified is None else tuple(certified)) == waves:
        return
    have = "all at once" if certified is None else f"in waves {format_waves(certified)}"
    fix = ("serve it without --orca-vote-waves" if certified is None else
           f"serve it with --orca-vote-waves {format_waves(certified)}")
    asked = "all at once" if waves is None else format_waves(waves)
    raise BundleError(f"--orca-vote-waves {asked}: the bundle's consensus margin t was certified "
                      f"for samples launched {have}, and t holds for that schedule only "
                      f"(docs/METHOD.md section 14); {fix}, or recalibrate with "
                      f"calibrate.consensus.waves")
