"""Group-conditional calibration's options, apart from orca_calibrate/calibrate.py (torch), so
that `orca-calibrate --help` and a job file's check can name them without importing torch.

`orca_calibrate.calibrate` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupOptions:
    """Group-conditional calibration (docs/METHOD.md section 12): the problems' tag that names
    their group (`field`: a trajectory set's problem field, e.g. `family`, or a key of its
    `extra`), fixed before calibration, and the fewest calibration traces (LTT's n_cal) a group
    needs for a table of its own; smaller groups get none (a printed note) and are served with
    the main table, through the shift gate."""

    field: str = "family"
    min_n: int = 30

    def __post_init__(self) -> None:
        if not isinstance(self.field, str) or not self.field or isinstance(self.min_n, bool) \
                or not isinstance(self.min_n, int) or self.min_n < 1:
            raise ValueError(f"calibrate.groups needs a field name and min_n >= 1, got "
                             f"field {self.field!r:.40}, min_n {self.min_n!r:.20}")
