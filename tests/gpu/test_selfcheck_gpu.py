"""The first-use self-check on a real GPU: the triton backend is probed when its first QuantLinear
and QuantMoE are built (cache dir emptied first), passes, is recorded and reused, and its cost is
printed (run with -s to see it):

    python3 -m pytest tests/gpu/test_selfcheck_gpu.py -q -s
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from quantdispatch import selfcheck
from quantdispatch.api import load_settings
from quantdispatch.formats import quantize_nvfp4
from quantdispatch.layers import QuantLinear, QuantMoE
from quantdispatch.resolver import _resolve

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
TRITON = load_settings({}, backend={"nvfp4": "triton"})


@pytest.fixture
def empty_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    selfcheck.reset()
    _resolve.cache_clear()
    yield tmp_path
    selfcheck.reset()
    _resolve.cache_clear()


def _w(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return quantize_nvfp4(torch.randn(n, k, generator=g) * 0.02)


def _only_result(before: dict) -> selfcheck.CheckResult:
    new = {k: v for k, v in selfcheck.results().items() if k not in before}
    assert len(new) == 1, new
    return next(iter(new.values()))


def _warm_cost(layer) -> float:
    """The probe again, kernels compiled: what a first use costs after compilation."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = selfcheck.run_probe("triton", layer.decision.request, DEV)
    cost = time.perf_counter() - t0
    assert result.passed, result.detail
    return cost


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
def test_triton_linear_is_self_checked_on_first_use(empty_cache, monkeypatch, act):
    before = selfcheck.results()
    t0 = time.perf_counter()
    layer = QuantLinear(_w(4096, 4096, 0), act_dtype=act, device=DEV, settings=TRITON)
    build = time.perf_counter() - t0
    assert layer.backend == "triton"
    result = _only_result(before)
    assert result.passed and result.backend == "triton", result.detail
    warm = _warm_cost(layer)
    print(
        f"\nself-check triton nvfp4 linear {layer.decision.request.act_name}: first use "
        f"{result.seconds:.3f} s (compilation included; layer build {build:.3f} s), after "
        f"compilation {warm * 1e3:.1f} ms; {result.detail}"
    )
    status = selfcheck.selfcheck_status("triton", layer.decision.device)
    assert status.startswith("self-check passed on this GPU"), status
    saved = json.loads(selfcheck.cache_path().read_text())
    assert any(e["passed"] for env in saved["entries"].values() for e in env.values())

    def no_probe(*args, **kwargs):
        raise AssertionError("probed twice")

    monkeypatch.setattr(selfcheck, "run_probe", no_probe)
    QuantLinear(_w(1024, 2048, 1), act_dtype=act, device=DEV, settings=TRITON)
    selfcheck.reset()  # a new process reads the pass from the cache file
    QuantLinear(_w(1024, 2048, 2), act_dtype=act, device=DEV, settings=TRITON)


def test_triton_moe_is_self_checked_on_first_use(empty_cache):
    def experts(n, k, seed):
        return [_w(n, k, seed + e) for e in range(8)]

    before = selfcheck.results()
    t0 = time.perf_counter()
    layer = QuantMoE(
        experts(768, 2048, 0), experts(768, 2048, 100), experts(2048, 768, 200),
        top_k=2, device=DEV, settings=TRITON,
    )  # fmt: skip
    build = time.perf_counter() - t0
    assert layer.backend == "triton"
    result = _only_result(before)
    assert result.passed and result.backend == "triton", result.detail
    warm = _warm_cost(layer)
    print(
        f"\nself-check triton nvfp4 moe bf16: first use {result.seconds:.3f} s (compilation "
        f"included; layer build {build:.3f} s), after compilation {warm * 1e3:.1f} ms; "
        f"{result.detail}"
    )
    x = torch.randn(5, 2048, device=DEV, dtype=torch.bfloat16)
    assert torch.isfinite(layer(x, torch.randn(5, 8, device=DEV))).all()
