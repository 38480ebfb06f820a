"""Fixtures shared by the estimator tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def process_flags():
    """Restores torch's deterministic-algorithms flags after a test that sets them."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
