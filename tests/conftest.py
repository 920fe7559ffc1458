"""Fixtures shared by the engine tests: the tiny model (built once per session) and its tokenizer.

A module that needs another `model` (e.g. a served model's id) defines its own fixture of that
name, which takes precedence within that module.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.core_sim import sim_bundle
from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    """The tiny model's folder; shared across sessions through the pytest base temp's parent."""
    return build_tiny_model(tmp_path_factory.getbasetemp().parent / "orca-tiny-model")


@pytest.fixture(scope="session")
def tok(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


# The simulated engine's bundles (tests/core_sim.py), module-scoped like the engines using them.
@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory):
    return sim_bundle(tmp_path_factory)


@pytest.fixture(scope="module")
def other_bundle_path(tmp_path_factory):
    """Another probe for the same model (hot reload): other scores, another checksum."""
    return sim_bundle(tmp_path_factory, seed=7)


@pytest.fixture(scope="module")
def keyword_bundle_path(tmp_path_factory):
    """Steps open at sections with the keyword "x" (sections merge, steps end one late)."""
    return sim_bundle(tmp_path_factory, keywords=["x"])
