"""The first-use self-check on the CPU, with fake backends installed under the name 'cutlass'
(first in the NVFP4 policy for linear and MoE): one computes correctly (the reference maths),
one is deliberately wrong by a factor. The CPU is let through the check's device rule here only.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from quantdispatch import selfcheck
from quantdispatch.api import load_settings, select
from quantdispatch.backends import BACKENDS
from quantdispatch.backends.reference import ReferenceBackend, ReferenceFacts
from quantdispatch.device import device_profile
from quantdispatch.errors import BackendUnavailableError
from quantdispatch.formats import quantize_nvfp4
from quantdispatch.layers import QuantLinear, QuantMoE
from quantdispatch.request import Op, Request
from quantdispatch.resolver import _resolve

NO_ENV = load_settings({})
pytestmark = pytest.mark.filterwarnings("ignore::quantdispatch.selfcheck.SelfCheckWarning")


class FakeFacts(ReferenceFacts):
    """Named like a native backend, runs nvfp4 on any device."""

    name = "cutlass"
    title = "fake backend for the self-check tests"
    supports = {"nvfp4": frozenset({Op.LINEAR, Op.MOE})}
    implemented = supports


class FakeNative(ReferenceBackend):
    """The reference maths times ``factor`` (1.0: right, else wrong), on any device."""

    facts = FakeFacts()

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.calls = 0

    def make_linear(self, w):
        run = super().make_linear(w)

        def scaled(x):
            self.calls += 1
            return (run(x).float() * self.factor).to(x.dtype)

        return scaled

    def moe(self, call):
        self.calls += 1
        return (super().moe(call).float() * self.factor).to(call.x.dtype)


@pytest.fixture
def env(monkeypatch, tmp_path):
    """A private cache dir, the CPU eligible, fresh process state."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(selfcheck, "ELIGIBLE_DEVICE_TYPES", ("cuda", "cpu"))
    selfcheck.reset()
    _resolve.cache_clear()
    yield tmp_path
    selfcheck.reset()
    _resolve.cache_clear()


def _install(monkeypatch, factor: float) -> FakeNative:
    fake = FakeNative(factor)
    monkeypatch.setitem(BACKENDS, "cutlass", fake)
    return fake


def _weight(seed=0, n=64, k=128):
    g = torch.Generator().manual_seed(seed)
    return quantize_nvfp4(torch.randn(n, k, generator=g) * 0.02)


def _layer(settings=NO_ENV):
    return QuantLinear(_weight(), device="cpu", settings=settings)


def _sc_warnings(record):
    return [w for w in record if issubclass(w.category, selfcheck.SelfCheckWarning)]


def test_wrong_backend_is_rejected_with_the_measured_error_and_the_next_one_runs(env, monkeypatch):
    fake = _install(monkeypatch, 1.5)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        layer = _layer()
        probe_calls = fake.calls
        second = _layer()
    assert layer.backend == "reference" and second.backend == "reference"
    assert probe_calls == 3 and fake.calls == 3  # one probe (M = 1, 48, 192), not a second
    line = next(c for c in layer.decision.trace if c.backend == "cutlass")
    assert not line.accepted
    assert line.reason.startswith("failed its self-check here: rel. error M=1: 5.0e-01")
    assert "above the bf16 bound 1e-02" in line.reason
    assert "fix: set QUANTDISPATCH_DISABLE=cutlass" in line.reason
    sc = _sc_warnings(record)
    assert len(sc) == 1
    assert "failed its self-check" in str(sc[0].message) and "QUANTDISPATCH_DISABLE=cutlass" in str(
        sc[0].message
    )
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    ref = QuantLinear(
        _weight(), device="cpu", settings=load_settings({}, backend={"nvfp4": "reference"})
    )
    assert torch.equal(layer(x), ref(x))
    # the failure is recorded for doctor, and plain select() in this process knows it too
    assert selfcheck.selfcheck_status("cutlass", device_profile("cpu")).startswith(
        "failed: nvfp4 linear W4A16 bf16"
    )
    d = select("nvfp4", scheme="weight_only", device="cpu", settings=NO_ENV)
    assert d.backend == "reference"
    saved = json.loads(selfcheck.cache_path().read_text())
    (entry,) = next(iter(saved["entries"].values())).values()
    assert entry["passed"] is False


def test_a_pass_is_recorded_and_reused_by_the_next_process(env, monkeypatch):
    fake = _install(monkeypatch, 1.0)
    profile = device_profile("cpu")
    assert selfcheck.selfcheck_status("cutlass", profile) == "not yet checked here"
    layer = _layer()
    assert layer.backend == "cutlass" and fake.calls == 3
    assert selfcheck.cache_path().is_file()
    status = selfcheck.selfcheck_status("cutlass", profile)
    assert (
        status.startswith("self-check passed on this GPU (") and "nvfp4 linear W4A16 bf16" in status
    )
    _layer()
    assert fake.calls == 3  # same process: no second probe
    selfcheck.reset()  # a new process: the disk says it passed
    _layer()
    assert fake.calls == 3
    # another activation dtype is another probe
    QuantLinear(_weight(), act_dtype=torch.float16, device="cpu", settings=NO_ENV)
    assert fake.calls == 6


def test_always_probes_in_every_process_and_off_never(env, monkeypatch):
    fake = _install(monkeypatch, 1.0)
    _layer()
    selfcheck.reset()
    _layer(load_settings({"QUANTDISPATCH_SELF_CHECK": "always"}))
    assert fake.calls == 6
    wrong = _install(monkeypatch, 2.0)
    selfcheck.reset()
    layer = _layer(load_settings({"QUANTDISPATCH_SELF_CHECK": "off"}))
    assert layer.backend == "cutlass" and wrong.calls == 0


def test_corrupt_cache_is_ignored_with_one_warning(env, monkeypatch):
    fake = _install(monkeypatch, 1.0)
    path = selfcheck.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert _layer().backend == "cutlass"
        QuantLinear(_weight(), act_dtype=torch.float16, device="cpu", settings=NO_ENV)
    sc = _sc_warnings(record)
    assert len(sc) == 1 and "is corrupt" in str(sc[0].message)
    assert fake.calls == 6
    assert json.loads(path.read_text())["version"] == 2  # rewritten with the results


def test_unwritable_cache_dir_is_ignored_with_one_warning(env, monkeypatch):
    blocker = env / "not-a-dir"
    blocker.write_text("a file where the cache directory would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    fake = _install(monkeypatch, 1.0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _layer()
        QuantLinear(_weight(), act_dtype=torch.float16, device="cpu", settings=NO_ENV)
        _layer()
    sc = _sc_warnings(record)
    assert len(sc) == 1 and "cannot write the self-check cache" in str(sc[0].message)
    assert fake.calls == 6  # kept in memory: no third probe


@pytest.mark.parametrize(
    "where",
    [("cuda", "is_current_stream_capturing"), ("compiler", "is_compiling")],
    ids=["cuda-graph-capture", "torch-compile-tracing"],
)
def test_skipped_under_capture_and_tracing_then_checked_at_the_next_eager_build(
    env, monkeypatch, where
):
    fake = _install(monkeypatch, 1.5)
    module = getattr(torch, where[0])
    monkeypatch.setattr(module, where[1], lambda: True)
    layer = _layer()
    assert layer.backend == "cutlass" and fake.calls == 0
    monkeypatch.setattr(module, where[1], lambda: False)
    _resolve.cache_clear()
    assert _layer().backend == "reference" and fake.calls == 3


def test_forced_backend_that_fails_raises(env, monkeypatch):
    _install(monkeypatch, 1.5)
    forced = load_settings({"QUANTDISPATCH_BACKEND_NVFP4": "cutlass"})
    with pytest.raises(BackendUnavailableError) as e:
        _layer(forced)
    msg = str(e.value)
    assert (
        "QUANTDISPATCH_BACKEND_NVFP4=cutlass forces backend 'cutlass', which failed its self-check"
        in msg
    )
    assert "rel. error M=1: 5.0e-01" in msg
    with pytest.raises(BackendUnavailableError, match="failed its self-check"):
        select("nvfp4", scheme="weight_only", device="cpu", settings=forced)  # the process knows


def test_moe_probe_rejects_a_wrong_moe_and_accepts_a_right_one(env, monkeypatch):
    g = torch.Generator().manual_seed(3)

    def experts(n, k):
        return [quantize_nvfp4(torch.randn(n, k, generator=g) * 0.02) for _ in range(4)]

    gate, up, down = experts(64, 128), experts(64, 128), experts(128, 64)
    fake = _install(monkeypatch, 0.5)
    layer = QuantMoE(gate, up, down, top_k=2, device="cpu", settings=NO_ENV)
    assert layer.backend == "reference" and fake.calls == 2  # M = 1 and 48
    line = next(c for c in layer.decision.trace if c.backend == "cutlass")
    assert "failed its self-check here: rel. error M=1: 5.0e-01" in line.reason
    selfcheck.reset()
    _resolve.cache_clear()
    right = _install(monkeypatch, 1.0)
    assert QuantMoE(gate, up, down, top_k=2, device="cpu", settings=NO_ENV).backend == "cutlass"
    assert right.calls == 2


def test_never_for_reference_simulated_or_cpu(env, monkeypatch):
    fake = _install(monkeypatch, 1.5)
    request = Request.make("nvfp4")
    cpu = device_profile("cpu")
    assert "contract" in selfcheck.skip_reason("reference", cpu, torch.device("cpu"), "once")
    assert "simulated" in selfcheck.skip_reason("cutlass", device_profile("b200"), None, "once")
    monkeypatch.setattr(selfcheck, "ELIGIBLE_DEVICE_TYPES", ("cuda",))
    assert "not a CUDA GPU" in selfcheck.skip_reason("cutlass", cpu, torch.device("cpu"), "once")
    assert selfcheck.ensure_checked("cutlass", request, cpu, torch.device("cpu")) is None
    assert _layer().backend == "cutlass" and fake.calls == 0
    d = select("nvfp4", device="b200", settings=NO_ENV, check_on="meta")
    assert d.backend == "cutlass" and fake.calls == 0
    assert selfcheck.selfcheck_status("reference", cpu).startswith("never checked")
    assert selfcheck.selfcheck_status("cutlass", device_profile("b200")).startswith("not checked")


def test_cache_key_names_gpu_driver_software_and_provider(env):
    profile = device_profile("b300")
    key = selfcheck.environment_key("triton", profile)
    for part in (
        "NVIDIA B300",
        "SM 10.3",
        "driver",
        "CUDA",
        "torch",
        "quantdispatch",
        "triton: triton",
    ):
        assert part in key
    assert (
        selfcheck.probe_key("triton", Request.make("nvfp4", "moe"))
        == "triton nvfp4 moe W4A4 bf16 -"
    )


def test_the_moe_probe_runs_on_the_reference_backend_within_its_bound():
    """The self-check's MoE probe (stacks -> prepare_moe -> the layers' op) on the CPU."""
    from quantdispatch.backends import get_backend
    from quantdispatch.checking import bound_for, probe_moe
    from quantdispatch.request import Request

    request = Request.make("nvfp4", "moe", torch.bfloat16)
    rows = probe_moe(get_backend("reference"), request, torch.device("cpu"))
    assert [m for m, _ in rows] == [1, 48]
    assert all(0 < err < bound_for(torch.bfloat16, False, moe=True) for _, err in rows), rows
