"""The bound call path (quantdispatch.backends.bound) without a GPU.

* Per preset, format and shape, the triton backend's bound steps run the family
  ``Decision.kernel_for`` names at every M, through that family's launcher class.
* On the CPU interpreter, bound and op paths give the same bits for every family that runs
  there (checkpoint tl.dot, FP8 tl.dot, dequantize + matmul, the wgmma GEMM's interpreter twin).
* A bound call does no dispatch work: no meta decoding, no backend or regime lookup, no config
  search, no weight checks; the Python functions it runs are counted, so the count cannot grow
  back unnoticed.
* QuantLinear's eager forward runs the bound path (reference backend on the CPU) and the
  layer drops it when its buffers move or are replaced.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (optional extra)")

from test_triton_dispatch import linear_tensors

import quantdispatch.ops
from quantdispatch.api import load_settings, select
from quantdispatch.backends import get_backend
from quantdispatch.backends.base import LinearBinding, as_op_tensors
from quantdispatch.backends.triton import bind, dispatch, prepare
from quantdispatch.device import preset_profile
from quantdispatch.errors import BackendUnavailableError
from quantdispatch.formats import quantize_fp8, quantize_mxfp4, quantize_nvfp4
from quantdispatch.kernels.checkpoint_layout.fp8 import Fp8Linear
from quantdispatch.kernels.checkpoint_layout.linear import Fp4Linear
from quantdispatch.kernels.common import launch
from quantdispatch.kernels.common.checks import interpreting
from quantdispatch.kernels.common.device_facts import DeviceFacts
from quantdispatch.kernels.common.slabs import DequantGemm
from quantdispatch.kernels.mma_layout.gemm import MmaGemm
from quantdispatch.kernels.mma_layout.gemv import MmaGemv
from quantdispatch.kernels.regimes import Family
from quantdispatch.layers import QuantLinear
from quantdispatch.request import Request

CLASSES = {
    Family.MMA_GEMV: MmaGemv,
    Family.WGMMA_GEMM: MmaGemm,
    Family.DEQUANT_CUBLAS: DequantGemm,
    Family.CHECKPOINT_TL_DOT: Fp4Linear,
    Family.FP8_TL_DOT: Fp8Linear,
}
MS = (1, 16, 17, 32, 33, 64, 65, 127, 128, 256, 257, 511, 512, 513, 4096)
CPU = torch.device("cpu")


def _unwrapped(fn):
    """The launcher object behind a step (mma16x64 steps check the dtype first)."""
    cells = getattr(fn, "__closure__", None) or ()
    inner = [c.cell_contents for c in cells if type(c.cell_contents) in CLASSES.values()]
    return inner[0] if inner else fn


@pytest.mark.parametrize("preset", ("h200", "a100", "t4", "b200"))
@pytest.mark.parametrize("fmt", ("nvfp4", "mxfp4", "fp8"))
def test_the_bound_steps_are_kernel_for_at_every_m(monkeypatch, preset, fmt):
    profile = preset_profile(preset)
    monkeypatch.setattr(bind, "device_facts", lambda device: dispatch.facts_for(profile))
    shapes = ((6144, 4096), (28672, 4096), (48, 4096))
    for act, (n, k) in itertools.product((torch.bfloat16, torch.float16), shapes):
        try:
            settings = load_settings({}, backend={fmt: "triton"})
            d = select(fmt, "linear", act, device=preset, settings=settings, n=n, k=k)
        except BackendUnavailableError:  # e.g. bf16 before SM 8.0
            continue
        layout = dispatch.linear_layout(fmt, n, k, act, profile.capability)
        meta = dispatch.prepared_meta(layout, act)
        tensors = tuple(linear_tensors(fmt, layout, n, k))
        bound = get_backend("triton").bind_linear(
            LinearBinding(tensors, None, fmt, layout, meta, True, CPU)
        )
        for m in MS:
            family = d.kernel_for(m).family
            assert bound.family_for(m) == family.value, (preset, act, n, k, m)
            step = next(fn for top, fn in bound.steps if top is None or m <= top)
            assert type(_unwrapped(step)) is CLASSES[Family(family)], (preset, n, k, m)


# ---- bits: bound == op on the interpreter ----------------------------------------------------

needs_interpreter = pytest.mark.skipif(
    not interpreting(), reason="the interpreter runs these kernels on CPU tensors"
)


def _weight(fmt, n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    w[: n // 8] *= 1e-3  # subnormal block scales
    if fmt == "nvfp4":
        return quantize_nvfp4(w)
    if fmt == "mxfp4":
        return quantize_mxfp4(w)
    return quantize_fp8(w, kind="block")


def _both(monkeypatch, fmt, n, k, ms, capability=None, facts=None):
    """(bound output, op output) per M for a triton-prepared weight on a simulated device."""
    facts = facts or DeviceFacts.for_capability(capability)
    from quantdispatch.backends.triton import run

    monkeypatch.setattr(prepare, "_capability", lambda device: capability)
    monkeypatch.setattr(run, "device_facts", lambda device: facts)
    monkeypatch.setattr(bind, "device_facts", lambda device: facts)
    request = Request.make(fmt, "linear", torch.bfloat16, "weight_only", n=n, k=k)
    backend = get_backend("triton")
    prepared = backend.prepare(_weight(fmt, n, k), request)
    tensors = as_op_tensors(list(prepared.tensors))
    bias = torch.randn(n)
    bound = backend.bind_linear(
        LinearBinding(tuple(tensors), bias, fmt, prepared.layout, prepared.meta, True, CPU)
    )
    out = []
    for m in ms:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        op = torch.ops.quantdispatch.linear(
            x, tensors, bias, "triton", fmt, prepared.meta_args(), n, True
        )
        out.append((m, bound.family_for(m), bound(x), op))
    return out


@needs_interpreter
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8"])
def test_bound_and_op_give_the_same_bits_on_the_checkpoint_layout(monkeypatch, fmt):
    # no GPU capability: the checkpoint layout; M 3 runs tl.dot, M 130 the dequantize path
    results = _both(monkeypatch, fmt, 96, 256, (3, 130))
    assert {r[1] for r in results} == {
        (Family.FP8_TL_DOT if fmt == "fp8" else Family.CHECKPOINT_TL_DOT).value,
        Family.DEQUANT_CUBLAS.value,
    }
    for m, family, got, want in results:
        assert torch.equal(got, want), (fmt, m, family)


@needs_interpreter
def test_bound_and_op_give_the_same_bits_on_the_wgmma_gemm(monkeypatch):
    # SM 9.0 without TMA (the interpreter has no descriptors): M 40 runs the wgmma GEMM's twin
    facts = replace(
        DeviceFacts.for_capability((9, 0)),
        tma=False,
        compiled=False,
        rs_wgmma_hazard=False,
        dependent_launches=False,
    )
    results = _both(monkeypatch, "nvfp4", 128, 256, (40,), capability=(9, 0), facts=facts)
    ((_, family, got, want),) = results
    assert family == Family.WGMMA_GEMM.value
    assert torch.equal(got, want)


# ---- no dispatch work per call ---------------------------------------------------------------

#: What the op path does per call and a bound call must not.
DISPATCH_WORK = {
    "decode_meta", "_decode", "get_backend", "linear_family", "linear_steps", "linear_regime",
    "linear_row", "fp8_row", "device_facts", "get_config", "gemv_config", "mma_gemm_config",
    "check_fp4_weights", "check_fp8_weights", "check_same_device", "check_bias", "as_op_tensors",
    "_signature", "_plan",
}  # fmt: skip


def _python_calls(fn):
    names: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return names


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_a_bound_call_does_no_dispatch_work(monkeypatch, fmt):
    launches: list[tuple] = []
    monkeypatch.setattr(launch.Launcher, "__call__", lambda self, grid, *v: launches.append(v))
    monkeypatch.setattr(prepare, "_capability", lambda device: None)
    n, k = 96, 256
    request = Request.make(fmt, "linear", torch.bfloat16, "weight_only", n=n, k=k)
    backend = get_backend("triton")
    prepared = backend.prepare(_weight(fmt, n, k), request)
    tensors = tuple(as_op_tensors(list(prepared.tensors)))
    bound = backend.bind_linear(
        LinearBinding(tensors, None, fmt, prepared.layout, prepared.meta, True, CPU)
    )
    x = torch.randn(4, k, dtype=torch.bfloat16)
    bound(x)  # the first call of an M makes its plan
    launches.clear()
    names = _python_calls(lambda: bound(x))
    assert len(launches) == 1
    assert not DISPATCH_WORK & set(names), sorted(DISPATCH_WORK & set(names))
    # BoundLinear.__call__, the launcher object's __call__, the output allocation, the launch
    assert len(names) <= 6, names


def test_the_op_path_does_that_work(monkeypatch):
    """The counter above sees dispatch work where there is some (the op path)."""
    monkeypatch.setattr(launch.Launcher, "__call__", lambda self, grid, *v: None)
    monkeypatch.setattr(prepare, "_capability", lambda device: None)
    n, k = 96, 256
    request = Request.make("nvfp4", "linear", torch.bfloat16, "weight_only", n=n, k=k)
    prepared = get_backend("triton").prepare(_weight("nvfp4", n, k), request)
    tensors, meta = as_op_tensors(list(prepared.tensors)), prepared.meta_args()
    x = torch.randn(4, k, dtype=torch.bfloat16)
    quantdispatch.ops.run_linear(x, tensors, None, "triton", "nvfp4", meta, n)
    names = _python_calls(
        lambda: quantdispatch.ops.run_linear(x, tensors, None, "triton", "nvfp4", meta, n)
    )
    assert {"decode_meta", "get_backend", "linear_family", "check_fp4_weights"} <= set(names)


# ---- the layer --------------------------------------------------------------------------------


def test_quant_linear_forward_runs_its_bound_path_and_drops_it_when_buffers_change():
    w = torch.randn(64, 128) * 0.05
    layer = QuantLinear.from_float(torch.nn.Linear(128, 64), "nvfp4")
    assert layer.backend == "reference" and layer._bound is None
    x = torch.randn(3, 2, 128, dtype=torch.bfloat16)
    y = layer(x)
    bound = layer._bound
    assert bound is not None and layer.bound() is bound
    op = torch.ops.quantdispatch.linear(
        x.reshape(6, 128), layer._tensors(), layer.bias, layer.backend, layer.format,
        layer._meta_args, 64, True,
    )  # fmt: skip
    assert torch.equal(y, op.reshape(3, 2, 64))
    layer.to(torch.device("cpu"))
    assert layer._bound is None
    layer(x)
    assert layer._bound is not None
    layer.bias = torch.zeros(64)
    assert layer._bound is None
    name = layer._names[0]
    layer(x)
    setattr(layer, name, getattr(layer, name).clone())
    assert layer._bound is None
    layer.load_state_dict(layer.state_dict(), assign=True)
    assert layer._bound is None
    del w


def test_copies_and_pickles_leave_the_bound_path_behind():
    import copy
    import io

    layer = QuantLinear.from_float(torch.nn.Linear(128, 64), "nvfp4")
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    y = layer(x)
    clone = copy.deepcopy(layer)
    assert clone._bound is None and torch.equal(clone(x), y)
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded._bound is None and torch.equal(loaded(x), y)


def test_a_bad_input_still_gets_the_layers_error():
    from quantdispatch.errors import InputError

    layer = QuantLinear.from_float(torch.nn.Linear(128, 64), "nvfp4")
    layer(torch.randn(2, 128, dtype=torch.bfloat16))
    with pytest.raises(InputError, match=r"built for torch\.bfloat16"):
        layer(torch.randn(2, 128, dtype=torch.float16))
    with pytest.raises(InputError, match="in_features = 128"):
        layer(torch.randn(2, 64, dtype=torch.bfloat16))
    with pytest.raises(InputError, match="in_features = 128"):
        layer(torch.tensor(1.0, dtype=torch.bfloat16))
    with pytest.raises(InputError, match="meta"):
        layer(torch.randn(2, 128, dtype=torch.bfloat16, device="meta"))
