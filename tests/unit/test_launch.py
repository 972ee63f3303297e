"""The direct launch (quantdispatch.kernels.common.launch) on the CPU, with a stand-in for a
Triton JIT kernel and its compiled kernel: which calls go through ``kernel[grid]``, which launch
the compiled kernel directly, with which arguments, in which order."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (optional extra)")

from quantdispatch.kernels.common import launch as L


def _kernel_body(x_ptr, w_ptr, out_ptr, M, N, BLOCK: tl.constexpr, EVEN: tl.constexpr = True):  # noqa: F821
    pass


class _Param:
    def __init__(self, name: str, constexpr: bool) -> None:
        self.name, self.is_constexpr = name, constexpr


class _Compiled:
    def __init__(self, log: list, key: tuple) -> None:
        self.function, self.packed_metadata, self.key = object(), ("meta", key), key
        self.log = log

    def run(self, *args):  # (grid x3, stream, function, packed, lm, enter, exit, *kernel args)
        self.log.append(("direct", args))


class JITFunction:
    """Stands in for triton.runtime.jit.JITFunction (the launcher checks the type's name)."""

    def __init__(self) -> None:
        self.fn = _kernel_body
        self.params = [_Param(n, n in ("BLOCK", "EVEN")) for n in
                       ("x_ptr", "w_ptr", "out_ptr", "M", "N", "BLOCK", "EVEN")]  # fmt: skip
        self.log: list = []
        self.compiled: dict = {}

    def __getitem__(self, grid):
        def slow(**kwargs):
            spec = tuple(
                (k, L._spec(v) if isinstance(v, (torch.Tensor, int)) else v)
                for k, v in sorted(kwargs.items())
            )
            self.log.append(("slow", grid, kwargs))
            return self.compiled.setdefault(spec, _Compiled(self.log, spec))

        return slow


@pytest.fixture
def gpu(monkeypatch):
    """The launcher's view of a GPU: direct launches available, device 0, stream 7."""
    monkeypatch.setattr(L, "direct_launch_available", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 7, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(L, "_COMPILED", {})
    monkeypatch.setattr(L, "_LAUNCHERS", {})
    monkeypatch.setattr(L, "_SPLITS", {})


def _aligned(n: int, offset: int = 0) -> torch.Tensor:
    base = torch.zeros(n + 8, dtype=torch.bfloat16)
    shift = (-base.data_ptr() // 2) % 8  # elements to the next 16-byte boundary
    return base[shift + offset : shift + offset + n]


def test_second_call_launches_the_compiled_kernel_with_every_argument_in_order(gpu):
    k = JITFunction()
    w = _aligned(64)
    bound = L.Launcher(k, ("x_ptr", "out_ptr", "M"), dict(w_ptr=w, N=64, BLOCK=32),
                       dict(num_warps=4))  # fmt: skip
    x, out = _aligned(64), _aligned(64)
    bound((2, 3), x, out, 16)
    assert [e[0] for e in k.log] == ["slow"]
    assert k.log[0][2] == dict(x_ptr=x, w_ptr=w, out_ptr=out, M=16, N=64, BLOCK=32, EVEN=True,
                               num_warps=4)  # fmt: skip
    x2, out2 = _aligned(64), _aligned(64)
    bound((5,), x2, out2, 32)  # same specialization: M % 16 == 0, aligned tensors
    kind, args = k.log[-1]
    assert kind == "direct"
    compiled = next(iter(k.compiled.values()))
    assert args[:9] == (5, 1, 1, 7, compiled.function, compiled.packed_metadata, None, None, None)
    assert args[9:] == (x2, w, out2, 32, 64, 32, True)


@pytest.mark.parametrize(
    ("m", "offset"), [(1, 0), (17, 0), (2**31, 0), (16, 1)], ids=["m1", "odd", "i64", "unaligned"]
)
def test_a_new_specialization_goes_through_triton(gpu, m, offset):
    k = JITFunction()
    bound = L.Launcher(k, ("x_ptr", "M"), dict(w_ptr=_aligned(8), out_ptr=_aligned(8), N=8,
                                               BLOCK=8))  # fmt: skip
    bound((1,), _aligned(8), 16)
    bound((1,), _aligned(8), 32)
    assert [e[0] for e in k.log] == ["slow", "direct"]
    bound((1,), _aligned(8, offset), m)
    assert k.log[-1][0] == "slow"
    bound((1,), _aligned(8, offset), m)
    assert k.log[-1][0] == "direct"


def test_launchers_of_the_same_kernel_and_specialization_share_what_triton_found(gpu):
    k = JITFunction()
    fixed = dict(w_ptr=_aligned(8), out_ptr=_aligned(8), N=8, BLOCK=8)
    L.Launcher(k, ("x_ptr", "M"), fixed)((1,), _aligned(8), 16)
    other = L.Launcher(k, ("x_ptr", "M"), dict(fixed, w_ptr=_aligned(8)))
    other((1,), _aligned(8), 16)
    assert [e[0] for e in k.log] == ["slow", "direct"]
    # another constexpr value is another kernel
    L.Launcher(k, ("x_ptr", "M"), dict(fixed, BLOCK=16))((1,), _aligned(8), 16)
    assert k.log[-1][0] == "slow"


def test_launch_hooks_or_another_device_take_tritons_path(gpu, monkeypatch):
    from triton import knobs

    k = JITFunction()
    bound = L.Launcher(k, ("x_ptr", "M"), dict(w_ptr=_aligned(8), out_ptr=_aligned(8), N=8,
                                               BLOCK=8))  # fmt: skip
    bound((1,), _aligned(8), 16)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    bound((1,), _aligned(8), 16)
    assert k.log[-1][0] == "slow"
    monkeypatch.undo()
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 7, raising=False)
    monkeypatch.setattr(L, "direct_launch_available", lambda: True)
    bound((1,), _aligned(8), 16)
    assert k.log[-1][0] == "slow"


def test_generic_launch_keys_constexprs_by_value_and_passes_every_argument(gpu):
    k = JITFunction()
    x, w, out = _aligned(8), _aligned(8), _aligned(8)
    L.launch(k, (4,), x, w, out, 16, 8, BLOCK=8, num_warps=2)
    L.launch(k, (4,), x, w, out, 32, 8, BLOCK=8, num_warps=2)
    assert [e[0] for e in k.log] == ["slow", "direct"]
    assert k.log[-1][1][9:] == (x, w, out, 32, 8, 8, True)
    L.launch(k, (4,), x, w, out, 32, 8, BLOCK=16, num_warps=2)  # another constexpr value
    L.launch(k, (4,), x, w, out, 32, 8, BLOCK=8, num_warps=4)  # another option
    assert [e[0] for e in k.log][-2:] == ["slow", "slow"]


def test_stand_ins_and_interpreted_kernels_always_take_tritons_path(gpu):
    class Fake:
        def __init__(self) -> None:
            self.calls = 0

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                self.calls += 1

            return run

    fake = Fake()
    L.launch(fake, (1,), 1, 2, A=3)
    L.launch(fake, (1,), 1, 2, A=3)
    bound = L.Launcher(fake, ("x",), dict(y=1))
    bound((1,), 2)
    bound((1,), 2)
    assert fake.calls == 4
