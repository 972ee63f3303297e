"""Shared test set-up.

- Without a CUDA GPU, Triton kernels run through the interpreter: TRITON_INTERPRET=1 must be set
  before triton is imported (it is read when kernels are decorated).
- Tests marked ``gpu`` are skipped without a CUDA GPU, with the resolver's own reason.
- The first-use self-check records its results under a temporary XDG_CACHE_HOME, never in the
  user's cache.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests must not inherit a developer's overrides.
for _key in [k for k in os.environ if k.startswith("QUANTDISPATCH_")] + [
    "SGLANG_FORCE_NVFP4_MARLIN"
]:
    os.environ.pop(_key, None)
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="quantdispatch-tests-cache-")


def _gpu_skip_reason() -> str:
    from quantdispatch import select

    decision = select("nvfp4", device=None)
    for c in decision.trace:
        if c.backend == "triton" and not c.accepted:
            return f"no usable CUDA GPU; the resolver says triton: {c.reason}"
    return "no usable CUDA GPU (torch.cuda.is_available() is False)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    gpu_items = [i for i in items if i.get_closest_marker("gpu")]
    if not gpu_items:
        return
    skip = pytest.mark.skip(reason=_gpu_skip_reason())
    for item in gpu_items:
        item.add_marker(skip)
