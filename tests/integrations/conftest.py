"""Integration tests run tiny models on the CPU: one intra-op thread is faster for them (and
avoids OpenMP spin-waiting when other processes share the cores); restored afterwards."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
