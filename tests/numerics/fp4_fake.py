"""Fake native NVFP4 providers for CPU tests, written from the documented contracts
(docs/design/native-fp4.md, section 5), not from the providers' code.

* ``fake_sgl_kernel()``: a module standing in for ``sgl_kernel`` 0.3.21 with
  ``scaled_fp4_quant(input, input_global_scale)`` (the quantization rule in float64 from
  nvfp4_act_ref, scales placed by the index formula of the 128x4 layout) and
  ``cutlass_scaled_fp4_mm(a, b, block_scale_a, block_scale_b, alpha, out_dtype)``;
* ``fake_vllm_gemm()``: ``torch.ops._C.cutlass_scaled_fp4_mm(out!, a, b, block_scale_a,
  block_scale_b, alpha) -> ()`` registered for the duration;
* ``FakeScaledMM``: ``torch._scaled_mm`` for FP4 operands.

Every GEMM checks what it receives (dtypes, shapes, contiguity, the padded 2-D scale shape, the
swizzled layout by gathering with the index formula, alpha fp32 with one element, the output
dtype) and computes the product in float64. What they prove: the adapters hand the providers
the documented arguments and the result matches the W4A4 contract. What they cannot prove: that
a provider's kernel behaves as documented (the GPU self-check does).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
from nvfp4_act_ref import ref_quantize, ref_swizzle_offset, ref_unpack
from ref64 import e2m1_from_bits, e4m3_from_bits

F64 = torch.float64


def _up(v: int, m: int) -> int:
    return -(-v // m) * m


def gather_scales(flat: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    """The [rows, groups] scale matrix read out of the 128x4 layout by the index formula."""
    bits = flat.reshape(-1).view(torch.uint8)
    idx = torch.tensor(
        [[ref_swizzle_offset(r, c, groups) for c in range(groups)] for r in range(rows)]
    )
    return e4m3_from_bits(bits[idx])


def _values(packed: torch.Tensor, scales: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    v = e2m1_from_bits(ref_unpack(packed)).reshape(rows, k // 16, 16)
    return (v * gather_scales(scales, rows, k // 16).unsqueeze(-1)).reshape(rows, k)


def check_gemm_args(a, b, scale_a, scale_b, alpha, out_dtype, *, rows_of_b_major=True):
    """The CUTLASS NVFP4 GEMM contract; returns (m, n, k)."""
    assert a.dtype == torch.uint8 and b.dtype == torch.uint8, (a.dtype, b.dtype)
    assert a.dim() == 2 and b.dim() == 2 and a.is_contiguous() and b.is_contiguous()
    assert a.shape[1] == b.shape[1], (a.shape, b.shape)
    m, n, k = a.shape[0], b.shape[0], 2 * a.shape[1]
    assert k % 32 == 0 and n % 32 == 0, (n, k)
    for sc, rows in ((scale_a, m), (scale_b, n)):
        assert sc.dtype == torch.float8_e4m3fn and sc.is_contiguous() and sc.dim() == 2
        assert tuple(sc.shape) == (_up(rows, 128), _up(k // 16, 4)), (tuple(sc.shape), rows, k)
    assert alpha.dtype == torch.float32 and alpha.numel() == 1
    assert out_dtype in (torch.bfloat16, torch.float16), out_dtype
    return m, n, k


def gemm64(a, b, scale_a, scale_b, alpha) -> torch.Tensor:
    m, n, k = a.shape[0], b.shape[0], 2 * a.shape[1]
    y = _values(a, scale_a, m, k) @ _values(b, scale_b, n, k).T
    return y * alpha.reshape(()).to(F64)


class FakeSglKernel(types.ModuleType):
    """``sgl_kernel`` 0.3.21's two NVFP4 entry points; records each call's arguments."""

    def __init__(self, *, alpha_ignored: bool = False):
        super().__init__("sgl_kernel")
        self.__version__ = "0.3.21"
        self.gemm_calls: list[dict] = []
        self.quant_calls: list[dict] = []
        self.alpha_ignored = alpha_ignored  # a deliberately wrong provider for the self-check

    def scaled_fp4_quant(self, input, input_global_scale):
        assert input.dtype in (torch.bfloat16, torch.float16) and input.dim() == 2
        assert input_global_scale.dtype == torch.float32 and input_global_scale.numel() == 1
        m, k = input.shape
        assert k % 16 == 0
        self.quant_calls.append({"m": m, "k": k, "s": float(input_global_scale)})
        codes, sf_code, _ = ref_quantize(input, float(input_global_scale))
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        rm, rk = _up(m, 128), _up(k // 16, 4)
        flat = torch.zeros(rm * rk, dtype=torch.uint8)
        for r in range(m):
            for c in range(k // 16):
                flat[ref_swizzle_offset(r, c, k // 16)] = int(sf_code[r, c])
        return packed, flat.view(torch.float8_e4m3fn).reshape(rm, rk)

    def cutlass_scaled_fp4_mm(self, a, b, block_scale_a, block_scale_b, alpha, out_dtype):
        m, n, k = check_gemm_args(a, b, block_scale_a, block_scale_b, alpha, out_dtype)
        self.gemm_calls.append({"m": m, "n": n, "k": k, "alpha": float(alpha), "out": out_dtype})
        one = torch.ones((), dtype=torch.float32)
        y = gemm64(a, b, block_scale_a, block_scale_b, one if self.alpha_ignored else alpha)
        return y.to(out_dtype)


VLLM_GEMM_SCHEMA = (
    "cutlass_scaled_fp4_mm(Tensor! out, Tensor a, Tensor b, Tensor block_scale_a, "
    "Tensor block_scale_b, Tensor alpha) -> ()"
)
VLLM_CALLS: list[dict] = []


def _vllm_gemm(out, a, b, block_scale_a, block_scale_b, alpha):
    m, n, k = check_gemm_args(a, b, block_scale_a, block_scale_b, alpha, out.dtype)
    assert tuple(out.shape) == (m, n) and out.is_contiguous()
    VLLM_CALLS.append({"m": m, "n": n, "k": k, "alpha": float(alpha), "out": out.dtype})
    out.copy_(gemm64(a, b, block_scale_a, block_scale_b, alpha).to(out.dtype))


@contextlib.contextmanager
def fake_vllm_gemm(schema: str = VLLM_GEMM_SCHEMA) -> Iterator[None]:
    """Register ``torch.ops._C.cutlass_scaled_fp4_mm`` (vLLM 0.33.0's schema) for the duration."""
    lib = torch.library.Library("_C", "FRAGMENT")
    try:
        lib.define(schema)
        lib.impl(schema.split("(")[0], _vllm_gemm, "CompositeExplicitAutograd")
        VLLM_CALLS.clear()
        yield
    finally:
        lib._destroy()


class FakeScaledMM:
    """``torch._scaled_mm`` for NVFP4 operands: checks the contract, float64 maths, fp32 out."""

    def __init__(self, scale_b_misread: bool = False):
        self.calls = 0
        self.scale_b_misread = scale_b_misread

    def __call__(self, mat_a, mat_b, scale_a, scale_b, bias=None, scale_result=None,
                 out_dtype=None, use_fast_accum=False):  # fmt: skip
        self.calls += 1
        fp4 = torch.float4_e2m1fn_x2
        assert mat_a.dtype == fp4 and mat_b.dtype == fp4
        m, kh = mat_a.shape
        n = mat_b.shape[1]
        assert mat_a.stride() == (kh, 1) and mat_b.stride() == (1, kh)
        k = 2 * kh
        for sc, rows in ((scale_a, m), (scale_b, n)):
            assert sc.dtype == torch.float8_e4m3fn and sc.is_contiguous()
            assert sc.numel() == _up(rows, 128) * _up(k // 16, 4)
        assert bias is None and scale_result is None and not use_fast_accum
        assert out_dtype == torch.float32
        a = _values(mat_a.view(torch.uint8), scale_a, m, k)
        sb = scale_b
        if self.scale_b_misread:  # read the weight scales row-major, as if unswizzled
            sb = torch.zeros_like(scale_b.view(torch.uint8))
            sb[: n * (k // 16)] = scale_b.view(torch.uint8)[: n * (k // 16)]
            vals = e4m3_from_bits(sb[: n * (k // 16)]).reshape(n, k // 16)
            b = e2m1_from_bits(ref_unpack(mat_b.t().view(torch.uint8))).reshape(n, k // 16, 16)
            b = (b * vals.unsqueeze(-1)).reshape(n, k)
        else:
            b = _values(mat_b.t().view(torch.uint8), sb, n, k)
        return (a @ b.T).to(torch.float32)
