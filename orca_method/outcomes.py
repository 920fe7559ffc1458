"""The closed sets of words the method and the server share, one enum each: how a request ended,
a choice's finish reason, the two thresholds' sides, the give-up policies and losses, the audit
guards' alarm actions and threshold sources, which steps an answer probe labels, LTT's p-values,
how a step keyword matches, a vote's weight. The values are the wire's words (JSON responses,
journals, bundle files and CLI choices hold them as plain strings, and a member compares equal
to its word); code compares members, never words.
Plain Python: the server's request path and the offline CLIs import it without torch."""

import math
from enum import StrEnum


class Ended(StrEnum):
    """How a request's reasoning ended (the response's `ended`, docs/SERVER.md; the offline
    two-sided evaluation, `orca_method.give_up.two_sided_ends`, uses the same names)."""

    EARLY = "early"  # the probe's stop: the answer is probably right already
    GAVE_UP = "gave_up"  # the give-up threshold: it will probably not end right
    FULL = "full"  # ran to its own end (or a token budget)


class FinishReason(StrEnum):
    """How a choice finished, in the chat API's words (vLLM's `finish_reason`; the Responses and
    Messages APIs' own are translated to these: orca_serve/api_server/apis.py); others, such as
    a tool call's, pass through as vLLM wrote them."""

    STOP = "stop"  # its own end, or a stop string or token
    LENGTH = "length"  # cut by max_tokens
    ABORT = "abort"  # aborted (the client left, or the server gave up on it)


class Side(StrEnum):
    """Which threshold a label serves: the stop's lambda* or the give-up's mu* (the keys of a
    selectively labelled trace's `extra.selective.resolved`: the label mode each side's steps
    were probed for)."""

    STOP = "stop"
    GIVE_UP = "give_up"


class GiveUpLoss(StrEnum):
    """What an audited give-up counts as a loss (the `loss` of the audit table's and of
    `orca-calibrate audit-report`'s give-up block): under reference labels, the certified loss
    of the bundle's give-up policy (`GiveUpPolicy.certified_loss`); under consistency labels,
    which cannot tell a right end from a wrong one, whether it gave up at all (docs/AUDIT.md,
    "The give-up risk")."""

    GAVE_UP = "gave_up"
    # under consistency labels: it gave up and the answer it served is not the final one
    # (`orca_method.give_up.changed_by_giving_up`): what a mu recalibrated on audits certifies
    CHANGED = "gave_up_and_changed_the_answer"
    RIGHT_AHEAD = "gave_up_with_a_right_answer_ahead"
    RIGHT_SOMEWHERE = "gave_up_on_a_trace_right_at_some_step"


class GiveUpPolicy(StrEnum):
    """What a request that gives up returns (`--orca-give-up-policy`, docs/SERVER.md): GUESS, its
    answer at that point, as a stop would; MESSAGE, no answer (the operator's message). Each has
    its own give-up loss (`orca_method.give_up.lost_by_giving_up`, docs/METHOD.md section 9)."""

    GUESS = "guess"
    MESSAGE = "message"

    @property
    def certified_loss(self) -> GiveUpLoss:
        """The loss its mu* is certified for: GUESS gave up with a right answer still ahead,
        MESSAGE gave up on a trace right at some step."""
        return _CERTIFIED_LOSS[self]


_CERTIFIED_LOSS = {GiveUpPolicy.GUESS: GiveUpLoss.RIGHT_AHEAD,
                   GiveUpPolicy.MESSAGE: GiveUpLoss.RIGHT_SOMEWHERE}


GIVE_UP_POLICIES: tuple[str, ...] = tuple(str(p) for p in GiveUpPolicy)  # what argparse lists


class OnAlarm(StrEnum):
    """What a guard does when its alarm fires (`--orca-on-alarm`, docs/AUDIT.md): REPORT only
    reports it; FALLBACK serves no early stop (and no give-up) while engaged; RECALIBRATE falls
    back until enough audits after the alarm are labelled, then serves LTT's lambda on them."""

    REPORT = "report"
    FALLBACK = "fallback"
    RECALIBRATE = "recalibrate"


ON_ALARM: tuple[str, ...] = tuple(str(a) for a in OnAlarm)  # what argparse lists


class LabelSteps(StrEnum):
    """Which steps get an answer probe (collect's `label_steps`, `--orca-audit-label-steps`):
    EVERY labelled step (every `label_every`-th and the last); SELECTIVE only those whose labels
    the losses read (the calibration split's: orca_method/selective.py; an audit's, the guards':
    orca_method/audit/labelling.py)."""

    EVERY = "every"
    SELECTIVE = "selective"


LABEL_STEPS: tuple[str, ...] = tuple(str(s) for s in LabelSteps)  # what argparse lists


class Source(StrEnum):
    """Where the threshold a request is served with comes from (a guard's `source`, the
    response's `lambda_source`, the journal's): the bundle's; the fallback (no early stop, or no
    give-up); a recalibration on the live audits (lambda only, `OnAlarm.RECALIBRATE`); or the
    table of the request's group (a bundle's `groups`, docs/METHOD.md section 12)."""

    BUNDLE = "bundle"
    FALLBACK = "fallback"
    AUDIT = "audit"
    GROUP = "group"


class PValue(StrEnum):
    """LTT's p-value for a threshold's loss count (a table's `pvalue`, `orca-calibrate calibrate
    --pvalue`; `orca_method.ltt.PVALUES` computes each): BINOMIAL, the exact binomial tail;
    HB, Hoeffding-Bentkus."""

    BINOMIAL = "binomial"
    HB = "hb"


PVALUE_CHOICES: tuple[str, ...] = tuple(str(p) for p in PValue)  # what argparse lists


class KeywordMatch(StrEnum):
    """How a step keyword matches a line (the bundle's `segmentation.keyword_match`): WORD, as a
    whole word in any case; SUBSTRING, verbatim, inside words too (the authors' rule)."""

    WORD = "word"
    SUBSTRING = "substring"


class Weighting(StrEnum):
    """A finished sample's vote in the consensus stop (a bundle's `consensus.weighting`,
    docs/METHOD.md section 14): SCORE, its smoothed probe score where it stopped; COUNT, 1."""

    SCORE = "score"
    COUNT = "count"

    def weight(self, score: float | None) -> float:
        """The vote weight of a sample whose last smoothed score is `score`, in [0, 1] (no score,
        or one not finite: 0 under SCORE); calibration and the server both count by it."""
        if self is Weighting.COUNT:
            return 1.0
        if score is None or not math.isfinite(score):
            return 0.0
        return min(max(float(score), 0.0), 1.0)
