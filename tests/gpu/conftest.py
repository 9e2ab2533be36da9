"""The GPU tests see the library's own default device: the suite's ``SCPDR_DEVICE=cpu``
(tests/conftest.py, for the CPU tests) is cleared for each of them."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _library_default_device(monkeypatch):
    monkeypatch.delenv("SCPDR_DEVICE", raising=False)
