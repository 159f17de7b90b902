"""Fault-suite fixtures: the tiny model folder whose tokenizer the mock workers announce.
(The fault table, ``fault_table``, is a session fixture of ``tests/conftest.py``: tests
outside this folder record rows too.)"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from workers.model.tiny import ensure_tiny_model

    return str(ensure_tiny_model())
