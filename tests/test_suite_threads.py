"""The suite's own setting (tests/conftest.py): every test process computes on one CPU thread, so two xdist
workers on two cores do not burn CPU time in OpenMP threads spinning for a core the other worker holds."""
import os

import torch


def test_tests_and_the_children_they_start_compute_on_one_thread():
    assert torch.get_num_threads() == 1
    assert os.environ["OMP_NUM_THREADS"] == "1"  # inherited by every child process a test starts
