"""The suite's own scheduling (``conftest.py``): every group it keeps on one xdist worker names tests that exist, so
a renamed test cannot silently leave its group (and the suite's time) behind."""
from __future__ import annotations

from pathlib import Path

import pytest

import conftest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


def test_every_group_names_tests_that_exist() -> None:
    assert conftest.GROUPS
    for prefix, group in conftest.GROUPS:
        path, _, test = prefix.partition("::")
        source = (ROOT / path).read_text()  # the module exists
        if test:
            assert f"def {test.rstrip('[')}(" in source, (group, prefix)
