"""Fixtures shared by the engine tests: the tiny model (built once per session) and its tokenizer.

A module that needs another `model` (e.g. a served model's id) defines its own fixture of that
name, which takes precedence within that module.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    """The tiny model's folder; shared across sessions through the pytest base temp's parent."""
    return build_tiny_model(tmp_path_factory.getbasetemp().parent / "orca-tiny-model")


@pytest.fixture(scope="session")
def tok(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)

