"""How a request's reasoning ended, one name each (the response's `ended`, docs/SERVER.md; the
offline two-sided evaluation, `orca_method.give_up.two_sided_ends`, uses the same names)."""

ENDED_EARLY = "early"  # the probe's stop: the answer is probably right already
GAVE_UP = "gave_up"  # the give-up threshold: it will probably not end right
FULL = "full"  # ran to its own end (or a token budget)
ENDED: tuple[str, ...] = (ENDED_EARLY, GAVE_UP, FULL)

# What a request that gives up returns (`--orca-give-up-policy`, docs/SERVER.md): "guess", its
# answer at that point, as a stop would; "message", no answer (the operator's message). Each
# has its own give-up loss (`orca_method.give_up.give_up_losses`, docs/METHOD.md section 9).
GIVE_UP_GUESS, GIVE_UP_MESSAGE = "guess", "message"
GIVE_UP_POLICIES: tuple[str, ...] = (GIVE_UP_GUESS, GIVE_UP_MESSAGE)
