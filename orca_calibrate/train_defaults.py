"""The training settings' defaults and choices, apart from orca_calibrate/train.py (torch, scipy), so
that `orca-calibrate --help` and a job file's check can name them without importing torch.

`orca_calibrate.train` re-exports DEFAULTS, EPOCH_SELECT and lr_for_batch.
"""

from orca_calibrate.job_options import check_number, check_whole

# Defaults of `meta_train` and of `orca-calibrate train` (no-QK epochs; QK uses 10). lr None:
# `lr_for_batch(batch_size)` below. Batch 32 is for speed (9.4x less CPU than batch 1
# at paper scale) and costs quality, measured in benchmarks/RESULTS.md ("Training protocol"):
# savings_per_problem 0.5-0.8 points lower at delta <= 0.1 on a 231-problem synthetic set,
# held-out loss 0.100 vs 0.072 on the toy job's 582 problems. batch_size 1 (lr 1e-3) is the
# paper's protocol.
DEFAULTS = {"batch_size": 32, "lr": None, "epochs": 20, "epoch_select": "last", "warmup": 0.0}

EPOCH_SELECT = ("validation", "last")  # how `meta_train` picks the epoch it keeps
DEFAULT_PROBE = "ttt-noqk"  # orca_calibrate.probe_variants.PROBES: the paper's main probe
DEFAULT_D_H = 128  # the QK variants' projection size
# the fewest training problems with a correct step meta-training takes (under epoch_select
# validation it holds one out and fits on the rest); the static probe's fit takes one
MIN_TRAIN_PROBLEMS = 2


PAPER_LR = 1e-3  # the paper's Adam learning rate, at one trajectory per step
MAX_RULE_BATCH = int(PAPER_LR ** -1.5)  # the largest batch the rule gives an lr <= 1


def lr_for_batch(batch_size: int) -> float:
    """Adam learning rate for a batch size: the paper's 1e-3 at batch 1, times batch^(2/3).

    A batch of B trajectories takes B times fewer Adam steps per epoch. At batch 32 and the
    paper's lr the probe stays undertrained (held-out outer loss 0.205 vs 0.159 at batch 1);
    32^(2/3) ~ 10 (lr 0.01) matched batch 1's held-out loss on a 231-problem synthetic set (not
    on the toy job's 582 problems: 0.100 vs 0.072), while the square-root rule's 5.7x
    sits between (3x: 0.175) and the linear rule's 32x overfit (train 0.09, held-out 0.169).
    Measured at batches 1 and 32 only.
    """
    return PAPER_LR * batch_size ** (2 / 3)


def check_training(batch_size: int, lr: float | None, epochs: int, epoch_select: str,
                   warmup: float) -> None:
    """ValueError (one line) for settings `meta_train` cannot run with: checked by it, and by a
    job file's check before collection (which may take hours) rather than after."""
    check_whole("batch_size", batch_size, 1)
    check_whole("epochs", epochs, 1)
    if lr is not None:
        check_number("lr", lr, 0, 1, low_open=True)
    elif lr_for_batch(batch_size) > 1:  # the rule's lr, named as such: the user set no lr
        raise ValueError(f"lr is not set, and batch_size {batch_size} gives "
                         f"{lr_for_batch(batch_size):.3g} by the batch rule ({PAPER_LR:g} x "
                         "batch_size^(2/3)), above 1: set lr, or a batch_size of at most "
                         f"{MAX_RULE_BATCH}")
    check_number("warmup", warmup, 0, 1, high_open=True)
    if epoch_select not in EPOCH_SELECT:
        raise ValueError(f"epoch_select is one of {', '.join(EPOCH_SELECT)}, "
                         f"got {epoch_select!r:.40}")
