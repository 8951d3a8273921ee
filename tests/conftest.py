"""Fixtures shared by the CPU tests that run whole pipelines on a tiny checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import calib_text_file, tiny_hf_dir


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory) -> Path:
    """A random checkpoint directory of the test module's CFG (a LlamaConfig)."""
    return tiny_hf_dir(tmp_path_factory, request.module.CFG)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    return calib_text_file(tmp_path_factory)
