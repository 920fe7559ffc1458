"""The consensus stop for k samples of one prompt (docs/METHOD.md section 14).

Each sample stops early by ORCA (its own lambda*), or runs to its end; the group of k samples
ends as soon as the samples already finished make the vote settled, and answers the vote of
their answers. The rule: with each finished sample's vote weighted by ``w_i`` in [0, 1] (its
probe score where it stopped, or 1 for plain counts), the leading answer's weight ``V_1``, the
runner-up's ``V_2`` and ``R`` samples still running, the group is settled when

    V_1 - V_2 > t * R,

that is, when the leader would still lead if every running sample voted for the runner-up with
weight t. At t = 1 the remaining samples cannot change the vote at all (a weight is at most 1);
smaller t bets that they will not all go against the leader. Optionally one confident sample may
settle it too (the confidence clause, a second parameter c): the group is also settled when the
leader's answer was given by a finished sample that ORCA stopped early within c reasoning tokens
(`stop_tokens`): a short, early stop is the reasoner's confident case, where one sample agrees
with the full vote most often (docs/METHOD.md section 14, "One confident sample"). t (and c) is
certified by Learn-then-Test (orca_method/consensus_ltt.py) so that the answer differs from the
plurality of all k samples run to their end (maj@k) with probability at most delta_vote.

Ties: a vote's plurality is the answer with the most weight, among equals the one given by the
lowest-numbered sample (the engine numbers a request's samples 0..k-1; so does collection).

Everything here is a pure function over arrays of k entries, so the engine core can call
`verdict` whenever a sample of a group finishes; nothing imports vLLM or a server library.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import numpy as np

# of the bundle's `consensus` block (orca_method/bundle.py): version 1 launches all k samples at
# once; version 2 adds the wave schedule its t was certified for (`waves`); version 3 the
# confidence clause (`confident`: its caps' path; each row's certified `cap`). A block without
# waves is still written as version 1, one without the clause as version 1 or 2, so such bundles
# keep their bytes and checksums
CONFIDENT_VERSION = 3
CONSENSUS_VERSION = 2
ALL_AT_ONCE_VERSION = 1
DEFAULT_GRID_SIZE = 101
# the confidence clause's caps c (reasoning tokens of an early stop), fixed before the data:
# DEFAULT_CAP_STEP, 2 DEFAULT_CAP_STEP, ... up to DEFAULT_CAP_MAX, tested in increasing order
DEFAULT_CAP_STEP = 25
DEFAULT_CAP_MAX = 4000
NO_CAP = -np.inf  # the confidence clause off: no sample's stop is within it
SAMPLE_SEP = "#"  # a sampled trace's id: "<prompt id>#<sample number>" (orca-calibrate collect)


def sample_id(prompt_id: str, sample: int) -> str:
    """The trajectory id of sample `sample` of a prompt (collection writes these)."""
    return f"{prompt_id}{SAMPLE_SEP}{sample}"


def prompt_of(trace_id: str) -> tuple[str, int]:
    """(prompt id, sample number) of a trajectory id; a trace without a sample part is sample 0."""
    head, sep, tail = trace_id.rpartition(SAMPLE_SEP)
    return (head, int(tail)) if sep and tail.isdigit() else (trace_id, 0)


def default_grid(m: int = DEFAULT_GRID_SIZE) -> np.ndarray:
    """``m`` margins t from 1.0 (the remaining samples cannot change the vote) down to 0.0 (the
    first finished sample decides), fixed before the data (LTT's hypotheses must be)."""
    if m < 2:
        raise ValueError(f"the consensus grid needs >= 2 points, got {m}")
    return np.linspace(1.0, 0.0, m)


def first_t(k: int, grid: np.ndarray | None = None) -> float:
    """The smallest t of `grid` under which no sample settles a group of k alone by the count
    rule (a lone finished sample has margin <= 1, not above t (k - 1)): where the confidence path
    (`confident_path`) leaves the t axis. Depends on k and the grid only, never on data."""
    grid = default_grid() if grid is None else np.asarray(grid, dtype=float)
    ok = grid[grid * (k - 1) >= 1.0]
    return float(ok.min()) if ok.size else float(grid.max())


def confident_path(k: int, grid: np.ndarray | None = None, cap_step: float = DEFAULT_CAP_STEP,
                   cap_max: float = DEFAULT_CAP_MAX) -> tuple[np.ndarray, np.ndarray]:
    """The hypotheses of the two-parameter rule, in the order LTT tests them, fixed in advance:
    (t [m], c [m]). First the margin alone (c off) from t = 1 down to `first_t`, as the count
    rule's own sequence; then, at that t, the cap c from `cap_step` up to `cap_max`; then, at
    `cap_max`, the rest of the grid's t below `first_t` (where a lone sample settles by the
    margin too, so the margin alone's lower t stay reachable). Along it each step settles more
    groups earlier, so the vote risk grows (nearly) monotonically, which is what makes a fixed
    sequence powerful: it stops at the first hypothesis it cannot reject."""
    grid = default_grid() if grid is None else np.asarray(grid, dtype=float)
    t0 = first_t(k, grid)
    above, below = grid[grid >= t0], grid[grid < t0]
    caps = np.arange(cap_step, cap_max + cap_step / 2, cap_step, dtype=float)
    return (np.concatenate([above, np.full(len(caps), t0), below]),
            np.concatenate([np.full(len(above), NO_CAP), caps, np.full(len(below), caps[-1])]))


@dataclass(frozen=True)
class Verdict:
    """The vote of a group's finished samples: its leader (None before any sample finished),
    the leader's margin V_1 - V_2, the samples still running, and whether it is settled."""

    settled: bool
    answer: Hashable | None
    margin: float
    running: int


def tally(answers: Sequence[Hashable], weights: np.ndarray,
          finished: np.ndarray) -> tuple[Hashable | None, float]:
    """(leader, V_1 - V_2) of the finished samples' weighted vote; ties to the lowest sample.

    answers [k] (any hashable, None included: "no answer" is a vote like any other),
    weights [k] in [0, 1], finished [k] bool.
    """
    votes: dict[Hashable, float] = {}
    first: dict[Hashable, int] = {}
    # over Python lists: per-element numpy indexing was most of a calibration's vote paths
    for i, (a, w, done) in enumerate(zip(answers, np.asarray(weights, dtype=float).tolist(),
                                            np.asarray(finished, dtype=bool).tolist())):
        if done:
            votes[a] = votes.get(a, 0.0) + w
            first.setdefault(a, i)
    if not votes:
        return None, 0.0
    ranked = sorted(votes, key=lambda a: (-votes[a], first[a]))
    runner_up = votes[ranked[1]] if len(ranked) > 1 else 0.0
    return ranked[0], votes[ranked[0]] - runner_up


def plurality(answers: Sequence[Hashable], weights: np.ndarray | None = None) -> Hashable | None:
    """The vote of all `answers` (maj@k when unweighted), ties to the lowest sample."""
    k = len(answers)
    w = np.ones(k) if weights is None else np.asarray(weights, dtype=float)
    return tally(answers, w, np.ones(k, dtype=bool))[0]


def verdict(answers: Sequence[Hashable], weights: np.ndarray, finished: np.ndarray,
            t: float, cap: float | None = None,
            stop_tokens: np.ndarray | None = None) -> Verdict:
    """The per-step decision: settled when V_1 - V_2 > t * (samples still running), when every
    sample has finished, or (confidence clause, `cap` not None) when a finished sample voting for
    the leader was stopped early by ORCA within `cap` reasoning tokens. `stop_tokens` [k]: each
    sample's reasoning tokens where ORCA stopped it, inf where it was not stopped early. Entries
    of running samples are ignored."""
    finished = np.asarray(finished, dtype=bool)
    _check_weights(weights)
    leader, margin = tally(answers, np.asarray(weights, dtype=float), finished)
    running = int((~finished).sum())
    back = backing(answers, finished, leader, stop_tokens)
    settled = leader is not None and bool(
        settles(margin, running, t, back, NO_CAP if cap is None else cap))
    return Verdict(settled=settled, answer=leader, margin=margin, running=running)


def backing(answers: Sequence[Hashable], finished: np.ndarray, leader: Hashable | None,
            stop_tokens: np.ndarray | None) -> float:
    """The fewest reasoning tokens at which a finished sample voting for `leader` was stopped
    early by ORCA (inf: none was; `stop_tokens` None: no sample was)."""
    if stop_tokens is None or leader is None:
        return np.inf
    mine = [s for a, s, done in zip(answers, np.asarray(stop_tokens, dtype=float).tolist(),
                                    np.asarray(finished, dtype=bool).tolist())
            if done and a == leader]
    return min(mine, default=np.inf)


def settles(margin: np.ndarray | float, running: np.ndarray | int, t: np.ndarray | float,
            back: np.ndarray | float = np.inf,
            cap: np.ndarray | float = NO_CAP) -> np.ndarray | bool:
    """The rule itself, elementwise: V_1 - V_2 > t * running, or nothing left running, or the
    leader backed by an early stop within the cap (`back <= cap`; `NO_CAP`: never). One
    definition for the engine's `verdict` and calibration's `settle_events` (the same floating
    point comparisons, so a (t, c) decides the same group the same way in both)."""
    return ((np.asarray(running) == 0)
            | (np.asarray(margin) > np.asarray(t) * np.asarray(running))
            | (np.asarray(back) <= np.asarray(cap)))


def _check_weights(weights: np.ndarray) -> None:
    w = np.asarray(weights, dtype=float)
    if not np.all((w >= 0.0) & (w <= 1.0)):  # also refuses NaN
        raise ValueError("vote weights must be in [0, 1] (a weight above 1 voids t = 1's "
                         "'the rest cannot change the vote')")


# ----------------------------------------------------------------------- groups, offline


@dataclass(frozen=True)
class Group:
    """k samples of one prompt as calibration sees them.

    ``finish`` [k]: when each sample finishes (stopped by ORCA or at its end), in the group's
    clock (engine steps: the samples decode in parallel, one token each per step);
    ``answers`` [k]: each one's answer there; ``weights`` [k]: its vote weight; ``reference``:
    the plurality of the k samples run to their end (the loss's target); ``start`` [k]: when
    each sample is launched (all at 0 unless launched in waves: `in_waves`). A sample not yet
    launched counts as running: it may still vote. ``stop_tokens`` [k]: the reasoning tokens at
    which ORCA stopped each sample early, inf for one that ran to its end (None: unknown, the
    confidence clause never fires); its own tokens, whatever its launch.
    """

    finish: np.ndarray
    answers: tuple[Hashable, ...]
    weights: np.ndarray
    reference: Hashable
    start: np.ndarray | None = None
    stop_tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        k = len(self.answers)
        if k < 1 or np.shape(self.finish) != (k,) or np.shape(self.weights) != (k,):
            raise ValueError("a group needs finish, answers and weights of the same length k >= 1")
        if self.start is not None and (np.shape(self.start) != (k,)
                                       or np.any(self.start > self.finish)):
            raise ValueError("start must be k launch times, none after its sample's finish")
        if self.stop_tokens is not None and np.shape(self.stop_tokens) != (k,):
            raise ValueError("stop_tokens must have one entry per sample")
        _check_weights(self.weights)

    def spent(self, at: float | np.ndarray) -> float | np.ndarray:
        """Tokens generated when the group ends at time `at` (or at each of the times `at`
        [E]: [E]): each launched sample its own until then (a sample launched later than `at`
        never ran)."""
        start = np.zeros_like(self.finish) if self.start is None else self.start
        ran = np.clip(np.asarray(at, dtype=float)[..., None] - start, 0.0,
                      self.finish - start)  # [..., k]
        out = ran.sum(axis=-1)
        return float(out) if out.ndim == 0 else out


WAVE_SEP = "+"  # a schedule's spelling: "1+1+2+4"


def check_waves(waves: Sequence[int], k: int) -> tuple[int, ...]:
    """A launch schedule for k samples: wave sizes >= 1 summing to k, in launch order."""
    out = tuple(int(w) for w in waves)
    if sum(out) != k or min(out, default=0) < 1:
        raise ValueError(f"waves {format_waves(out)} must be positive sizes summing to k = {k}")
    return out


def parse_waves(text: str) -> tuple[int, ...]:
    """"1+1+2+4" -> (1, 1, 2, 4) (the operator's and the benchmark's spelling)."""
    try:
        out = tuple(int(x) for x in text.split(WAVE_SEP))
    except ValueError:
        raise ValueError(f"a wave schedule is sizes joined by '{WAVE_SEP}' (e.g. 1+1+2+4), "
                         f"got {text!r:.40}") from None
    return check_waves(out, sum(out))


def format_waves(waves: Sequence[int]) -> str:
    return WAVE_SEP.join(str(w) for w in waves)


def block_version(waves: Sequence[int] | None, confident: bool = False) -> int:
    """The version a consensus block is written with: 1 when all samples launch at once, 2 in
    waves, 3 with the confidence clause."""
    if confident:
        return CONFIDENT_VERSION
    return ALL_AT_ONCE_VERSION if waves is None else CONSENSUS_VERSION


def in_waves(lengths: np.ndarray, waves: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(start [k], finish [k]) of samples launched in waves of the given sizes (sum k), in sample
    order, Adaptive-Consistency style: a wave starts once every sample before it has finished.
    `lengths` [k]: each sample's own tokens to its finish."""
    lengths = np.asarray(lengths, dtype=float)
    waves = check_waves(waves, len(lengths))
    start, at, i = np.zeros_like(lengths), 0.0, 0
    for size in waves:
        start[i:i + size] = at
        at += float(lengths[i:i + size].max())
        i += size
    return start, start + lengths


def launched(groups: Sequence[Group], waves: Sequence[int] | None) -> list[Group]:
    """`groups` (all launched at once) as launched in `waves` (None: unchanged)."""
    if waves is None:
        return list(groups)
    return [replace(g, start=start, finish=finish) for g in groups
            for start, finish in [in_waves(g.finish, waves)]]


@dataclass(frozen=True)
class VotePath:
    """A group's vote at each distinct finish time (its events, in time order): when (``times``
    [E]), the leader then (``leaders``, E entries), its margin V_1 - V_2 (``margins`` [E]) and
    the samples still running (``running`` [E]; 0 at the last event) and the leader's
    `backing` (``backing`` [E]: its fewest early-stop tokens among the finished, inf if none)."""

    times: np.ndarray
    leaders: tuple[Hashable, ...]
    margins: np.ndarray
    running: np.ndarray
    backing: np.ndarray


def vote_path(g: Group) -> VotePath:
    """The events of a group, as `verdict` sees the group at each."""
    times = np.unique(g.finish)  # [E], ascending
    leaders, margins, running, backs = [], [], [], []
    for s in times:
        finished = g.finish <= s
        leader, margin = tally(g.answers, g.weights, finished)
        leaders.append(leader)
        margins.append(margin)
        running.append(int((~finished).sum()))
        backs.append(backing(g.answers, finished, leader, g.stop_tokens))
    return VotePath(times=times, leaders=tuple(leaders), margins=np.asarray(margins),
                    running=np.asarray(running), backing=np.asarray(backs))


def settle_events(path: VotePath, grid: np.ndarray, caps: np.ndarray | None = None) -> np.ndarray:
    """[len(grid)] the event at which the group settles for each t of `grid` (`settles`), with
    the confidence clause's cap `caps` [len(grid)] beside it (None: off); the last event always
    settles."""
    grid = np.asarray(grid, dtype=float)
    caps = np.full(len(grid), NO_CAP) if caps is None else np.asarray(caps, dtype=float)
    hit = settles(path.margins[None, :], path.running[None, :], grid[:, None],
                  path.backing[None, :], caps[:, None])  # [m, E]
    return hit.argmax(axis=1)


def outcomes(groups: Sequence[Group], grid: np.ndarray,
             caps: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """[m, n] 0/1 losses (the group's answer is not its reference) and [m, n] tokens spent, for
    every hypothesis (t of `grid`, cap of `caps`; None: no confidence clause) and every group."""
    grid = np.asarray(grid, dtype=float)
    loss = np.zeros((len(grid), len(groups)), dtype=np.int8)
    tokens = np.zeros((len(grid), len(groups)))
    for j, g in enumerate(groups):
        path = vote_path(g)
        e = settle_events(path, grid, caps)  # [m]
        wrong = np.array([a != g.reference for a in path.leaders], dtype=np.int8)  # [E]
        cost = g.spent(path.times)  # [E]
        loss[:, j], tokens[:, j] = wrong[e], cost[e]
    return loss, tokens
