"""Bounded fuzzing of the three input readers (targets and oracles: tests/fuzzing.py).

Derandomized, so every run tries the same inputs; `benchmarks/fuzz_inputs.py` runs the same
targets for longer with fresh randomness.
"""

from __future__ import annotations

import fuzzing
from hypothesis import HealthCheck, given, settings

BOUNDED = settings(max_examples=300, derandomize=True, database=None, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@BOUNDED
@given(fuzzing.bundle_bytes())
def test_bundle_loader_on_bytes(raw: bytes) -> None:
    fuzzing.check_bundle_bytes(raw)


@BOUNDED
@given(fuzzing.mutated_bundle())
def test_bundle_loader_on_mutated_bundles(case: tuple[bytes, bool]) -> None:
    fuzzing.check_bundle_bytes(*case)


@BOUNDED
@given(fuzzing.segmenter_case())
def test_segmenter(case: dict) -> None:
    fuzzing.check_segmenter(case)


@BOUNDED
@given(fuzzing.corrupted_directory())
def test_trajectory_directory_reader(files: dict) -> None:
    fuzzing.check_directory(files)


@BOUNDED
@given(fuzzing.corrupted_pickle())
def test_research_pickle_reader(data: bytes) -> None:
    fuzzing.check_pickle(data)


def test_valid_inputs_are_accepted() -> None:
    """The oracles' baseline: the unmutated inputs load and pass every check."""
    for text in fuzzing.valid_bundles():
        fuzzing.check_bundle_bytes(text.encode(), good_weights=True)
    import json
    assert all(fuzzing.bundle_violation(json.loads(t)) is None for t in fuzzing.valid_bundles())
    fuzzing.check_directory(dict(fuzzing.valid_directory("float16")))
    import pickle
    fuzzing.check_pickle(pickle.dumps(fuzzing.valid_pickle()))
