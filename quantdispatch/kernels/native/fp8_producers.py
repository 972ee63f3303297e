"""Fused norms and activations, optionally producing FP8 prefill activations: the kernel that
makes an activation can also quantize it, so the FP8 linears that read it need no pass of their
own. One kernel each replaces the eager modules' chains of small ops (the HF integration's
fused ops, quantdispatch.integrations.transformers.fused_ops).

* :func:`rmsnorm`: ``weight * bf16(x * rsqrt(mean(x^2) + eps))``, the RMSNorm of the Llama
  family (HF's ``LlamaRMSNorm`` and its copies), rounded as it rounds: fp32 inside, once to the
  input dtype before the weight, once after; optionally after the residual add ``x + r``
  (rounded once, as eager's add), whose result it also returns.
* :func:`silu_mul_fp8`: ``bf16(silu(gate)) * up``, the gated MLP's input to ``down_proj``.

Each writes the 16-bit output (the tensor the model passes on) and, with ``quantize``, its
e4m3 codes and ``scale_a`` per token and per 128 columns (M padded to 16, zero rows), exactly
what :func:`.fp8_prefill.quantize_activations` gives for that output: the same block rule,
the same rounding helpers (:mod:`.fp8_prefill_quant`). The caller offers the codes to its
activation handoff (:class:`.fp8_handoff.ActivationHandoff`), where the next FP8 linears
reading the output find them.

The 16-bit results match torch's to within its own fp32 rounding: the sums of squares are
added in another order, ``rsqrt`` and ``exp`` are other routines, so an element can land a
16-bit step away from the eager module's (two steps after the norm's weight: a step of the
normalized value is two of a product in the binade below). The codes are always those of the
output written here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.errors import InputError, format_error
from quantdispatch.kernels.common.launch import Launcher, launch
from quantdispatch.kernels.native.fp8_prefill_quant import (
    _block_scales,
    _dense_amax,
    _dense_encode,
    _dense_load,
    block_exponent,
    e4m3_bytes,
    hw_rounding,
    pow2,
    widen16,
)

__all__ = ["RmsNorm", "SiluMul", "rmsnorm", "rmsnorm_fp8", "silu_mul_fp8"]

_16_BIT = (torch.bfloat16, torch.float16)


@triton.jit
def _round16(v, BF16: tl.constexpr):
    """fp32 -> the nearest bf16 / fp16 value (ties to even), kept as fp32. bf16 by integer
    rounding (the interpreter has no bf16 cast of its own)."""
    if BF16:
        bits = v.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
        return tl.where(v != v, v, r.to(tl.float32, bitcast=True))
    else:
        return v.to(tl.float16).to(tl.float32)


@triton.jit
def _narrow(v, BF16: tl.constexpr):
    """fp32 holding a 16-bit value (:func:`_round16`) -> what to store: bf16 bits or fp16."""
    if BF16:
        return (v.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
    else:
        return v.to(tl.float16)


@triton.jit
def _store16(y_ptr, v, rows64, valid, kc, stride_y, BF16: tl.constexpr):
    cols = tl.arange(0, 128)
    offs = rows64[:, None] * stride_y + kc * 128 + cols[None, :]
    tl.store(y_ptr + offs, _narrow(v, BF16), mask=valid[:, None])


@triton.jit
def _quantize_chunk(q_ptr, qs_ptr, y, pid_r, rows64, inside, kc, stride_q, stride_qs_r,
                    stride_qs_k, valid, BLOCK_R: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    y = tl.where(valid[:, None], y, 0.0)  # padding rows are +0 (a -0 weight would make -0)
    e_rows = _block_scales(_dense_amax(y), qs_ptr, qs_ptr, pid_r, rows64, inside, kc,
                           stride_qs_r, stride_qs_k, False, False, BLOCK_R)  # fmt: skip
    _dense_encode(q_ptr, y, e_rows, rows64, inside, kc, stride_q, HW)


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, s_ptr, w_ptr, y_ptr, q_ptr, qs_ptr, n_valid, n_rows, k, eps,
                    stride_x, stride_r, stride_s, stride_y, stride_q, stride_qs_r, stride_qs_k,
                    RES: tl.constexpr, QUANT: tl.constexpr, BF16: tl.constexpr,
                    BLOCK_R: tl.constexpr, CH: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    """Whole rows in registers as [rows, 128-column blocks, 128]: x is read once, and each
    block's largest value is a reduction over the last axis. RES: x + r first, rounded to the
    16-bit dtype and stored to s (the residual stream), then normalized, as the eager ``x + r``
    followed by the norm."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < n_valid  # rows n_valid .. n_rows: zero codes, scale 0 (the GEMM's padding)
    inside = rows < n_rows
    rows2 = rows.to(tl.int64)[:, None]
    rows64 = rows2[:, :, None]
    ch = tl.arange(0, CH)
    cols = ch[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    cmask = cols < k
    m3 = valid[:, None, None] & cmask
    x = widen16(tl.load(x_ptr + rows64 * stride_x + cols, mask=m3, other=0), BF16)
    if RES:
        x = _round16(x + widen16(tl.load(r_ptr + rows64 * stride_r + cols, mask=m3, other=0),
                                 BF16), BF16)  # fmt: skip
        tl.store(s_ptr + rows64 * stride_s + cols, _narrow(x, BF16), mask=m3)
    r = 1.0 / tl.sqrt_rn(tl.sum(tl.sum(x * x, axis=2), axis=1) / k + eps)
    w = widen16(tl.load(w_ptr + cols, mask=cmask, other=0), BF16)
    y = _round16(w * _round16(x * r[:, None, None], BF16), BF16)
    y = tl.where(m3, y, 0.0)  # padding rows are +0 (a -0 weight would make -0)
    tl.store(y_ptr + rows64 * stride_y + cols, _narrow(y, BF16), mask=m3)
    if QUANT:
        a = tl.abs(y)
        amax = tl.max(tl.where(a != a, float("inf"), a), axis=2)  # NaN counts as infinite
        e = block_exponent(amax)
        tl.store(qs_ptr + rows2 * stride_qs_r + ch[None, :] * stride_qs_k,
                 tl.where(amax == 0.0, 0.0, pow2(e)),
                 mask=inside[:, None] & (ch[None, :] * 128 < k))  # fmt: skip
        tl.store(q_ptr + rows64 * stride_q + cols, e4m3_bytes(y * pow2(-e)[:, :, None], HW),
                 mask=inside[:, None, None] & cmask)  # fmt: skip


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, q_ptr, qs_ptr, n_valid, n_rows, stride_g, stride_u,
                     stride_y, stride_q, stride_qs_r, stride_qs_k, QUANT: tl.constexpr,
                     BF16: tl.constexpr, BLOCK_R: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    pid_r = tl.program_id(0)
    kc = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < n_valid
    inside = rows < n_rows
    rows64 = rows.to(tl.int64)
    g = _dense_load(g_ptr, rows64, valid, kc, stride_g, BF16)
    u = _dense_load(u_ptr, rows64, valid, kc, stride_u, BF16)
    s = _round16(g / (1.0 + tl.exp(-g)), BF16)
    y = _round16(s * u, BF16)
    _store16(y_ptr, y, rows64, valid, kc, stride_y, BF16)
    if QUANT:
        _quantize_chunk(q_ptr, qs_ptr, y, pid_r, rows64, inside, kc, stride_q, stride_qs_r,
                        stride_qs_k, valid, BLOCK_R, HW)  # fmt: skip


def _check(where: str, x: torch.Tensor, name: str, k: int | None = None, blocks=True) -> None:
    if x.dim() != 2 or x.dtype not in _16_BIT or x.stride(1) != 1:
        raise InputError(
            format_error(
                f"{where}: {name} is {x.dtype} {tuple(x.shape)} with strides {x.stride()}",
                f"{name} is a 2-D bf16 / fp16 matrix with contiguous rows",
                f"pass {name}.reshape(-1, {name}.shape[-1]).contiguous()",
            )
        )
    if (blocks and x.shape[1] % 128) or (k is not None and x.shape[1] != k):
        raise InputError(
            format_error(
                f"{where}: {name} has {x.shape[1]} columns",
                ("the kernel works in blocks of 128 columns" if blocks else "")
                + ("" if k is None else f"; it must match the other input's {k}"),
                "run the module's own forward for this width",
            )
        )


def _outputs(x: torch.Tensor, quantize: bool):
    m, k = x.shape
    y = torch.empty_like(x)
    if not quantize:
        return y, None, None
    mp = -(-m // 16) * 16
    q = torch.empty((mp, k), dtype=torch.uint8, device=x.device)
    scale = torch.empty((k // 128, mp), dtype=torch.float32, device=x.device).t()
    return y, q, scale


def _finish(y, q, scale, quantize: bool):
    if not quantize:
        return y, None
    return y, (q.view(torch.float8_e4m3fn), scale)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    quantize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """(y, s, codes): the RMSNorm y of x [M, K] with ``weight`` [K] (same dtype); with
    ``residual`` [M, K], of s = x + residual (rounded to the dtype, returned: the residual
    stream), else s is None; with ``quantize`` (K a multiple of 128) y's FP8 form, else
    None."""
    _check("rmsnorm", x, "x", blocks=quantize)
    if residual is not None:
        _check("rmsnorm", residual, "residual", x.shape[1], blocks=quantize)
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype or weight.device != x.device:
        raise InputError(
            format_error(
                f"rmsnorm: weight is {weight.dtype} {tuple(weight.shape)} on {weight.device}",
                f"the norm's weight is [{x.shape[1]}] in x's dtype {x.dtype} on {x.device}",
                "run the module's own forward",
            )
        )
    y, q, scale = _outputs(x, quantize)
    s = torch.empty_like(x) if residual is not None else None
    m, k = x.shape
    rows = q.shape[0] if quantize else m
    if rows:
        block_k = max(128, triton.next_power_of_2(k))
        br = max(1, 2048 // block_k)  # at least 2048 elements per program
        bf16 = x.dtype == torch.bfloat16
        view = (lambda t: t.view(torch.int16)) if bf16 else (lambda t: t)
        res = residual if residual is not None else x
        launch(_rmsnorm_kernel, (triton.cdiv(rows, br),),
            view(x), view(res), view(s if s is not None else y), view(weight.contiguous()),
            view(y), q if quantize else y, scale if quantize else x, m, rows, k, float(eps),
            x.stride(0), res.stride(0), s.stride(0) if s is not None else 0, y.stride(0),
            q.stride(0) if quantize else 0, scale.stride(0) if quantize else 0,
            scale.stride(1) if quantize else 0, RES=residual is not None, QUANT=quantize,
            BF16=bf16, BLOCK_R=br, CH=block_k // 128, HW=quantize and hw_rounding(x.device),
            num_warps=min(16, max(4, br * block_k // 512)),
        )  # fmt: skip
    y, codes = _finish(y, q, scale, quantize)
    return y, s, codes


def rmsnorm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, quantize: bool = True
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(y, (codes, scale_a) or None): :func:`rmsnorm` of x without a residual."""
    y, _, codes = rmsnorm(x, weight, eps, quantize=quantize)
    return y, codes


def silu_mul_fp8(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    quantize: bool = True,
    rows_per_program: int = 32,
    num_warps: int = 4,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(y, (codes, scale_a) or None): ``silu(gate) * up`` for gate, up [M, I] (rows
    contiguous, any row stride: halves of one [M, 2I] projection work), and with
    ``quantize`` its FP8 form. ``rows_per_program`` /
    ``num_warps``: the program shape (one 128-column block each), for tuning."""
    _check("silu_mul_fp8", gate, "gate")
    _check("silu_mul_fp8", up, "up", gate.shape[1])
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise InputError(
            format_error(
                f"silu_mul_fp8: gate {gate.dtype} {tuple(gate.shape)}, up {up.dtype} "
                f"{tuple(up.shape)}",
                "gate and up have one shape, dtype and device",
                "pass the two halves of the same projection",
            )
        )
    y, q, scale = _outputs(gate, quantize)
    m, k = gate.shape
    rows = q.shape[0] if quantize else m
    if rows:
        br = rows_per_program
        bf16 = gate.dtype == torch.bfloat16
        view = (lambda t: t.view(torch.int16)) if bf16 else (lambda t: t)
        launch(_silu_mul_kernel, (triton.cdiv(rows, br), k // 128),
            view(gate), view(up), view(y), q if quantize else y, scale if quantize else gate,
            m, rows, gate.stride(0), up.stride(0), y.stride(0), q.stride(0) if quantize else 0,
            scale.stride(0) if quantize else 0, scale.stride(1) if quantize else 0,
            QUANT=quantize, BF16=bf16, BLOCK_R=br, HW=quantize and hw_rounding(gate.device),
            num_warps=num_warps,
        )  # fmt: skip
    return _finish(y, q, scale, quantize)


class RmsNorm:
    """:func:`rmsnorm` without FP8 codes for one norm weight, its launches bound once (the HF
    integration's eager fused ops): ``norm(x)`` -> y, ``norm(x, residual)`` -> (y, s), for
    contiguous x [M, K] (and residual) in the weight's dtype. Same kernel, same bits."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        if weight.dim() != 1 or weight.dtype not in _16_BIT:
            raise InputError(
                format_error(
                    f"RmsNorm: weight is {weight.dtype} {tuple(weight.shape)}",
                    "a norm weight is a [K] bf16 / fp16 vector",
                    "run the module's own forward",
                )
            )
        self.weight, self.k, self.dtype = weight, weight.shape[0], weight.dtype
        self.weight_ptr = weight.data_ptr()  # the caller rebinds when its weight moves
        bf16 = weight.dtype == torch.bfloat16
        self._view = (lambda t: t.view(torch.int16)) if bf16 else (lambda t: t)
        block_k = max(128, triton.next_power_of_2(self.k))
        self._br = max(1, 2048 // block_k)
        w = self._view(weight.contiguous())
        fixed = dict(
            w_ptr=w, q_ptr=w, qs_ptr=w, k=self.k, eps=float(eps), stride_q=0, stride_qs_r=0,
            stride_qs_k=0, QUANT=False, BF16=bf16, BLOCK_R=self._br, CH=block_k // 128,
            HW=False,
        )  # fmt: skip
        options = dict(num_warps=min(16, max(4, self._br * block_k // 512)))
        rows = ("y_ptr", "n_valid", "n_rows", "stride_x", "stride_y")
        self._plain = Launcher(
            _rmsnorm_kernel, ("x_ptr", *rows),
            dict(fixed, r_ptr=w, s_ptr=w, stride_r=0, stride_s=0, RES=False), options,
        )  # fmt: skip
        self._res = Launcher(
            _rmsnorm_kernel, ("x_ptr", "r_ptr", "s_ptr", *rows, "stride_r", "stride_s"),
            dict(fixed, RES=True), options,
        )  # fmt: skip

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
        m = x.shape[0]
        y = torch.empty_like(x)
        grid = ((m + self._br - 1) // self._br,)
        v = self._view
        if residual is None:
            if m:
                self._plain(grid, v(x), v(y), m, m, x.stride(0), y.stride(0))
            return y
        s = torch.empty_like(x)
        if m:
            self._res(grid, v(x), v(residual), v(s), v(y), m, m, x.stride(0), y.stride(0),
                      residual.stride(0), s.stride(0))  # fmt: skip
        return y, s


class SiluMul:
    """:func:`silu_mul_fp8` without FP8 codes with its launch bound once, for [M, I] inputs of
    one width and dtype on one device (the eager fused MLP): ``silu_mul(gate, up)`` -> y."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device) -> None:
        if width % 128 or dtype not in _16_BIT:
            raise InputError(
                format_error(
                    f"SiluMul: width {width}, {dtype}",
                    "the kernel takes bf16 / fp16 rows in blocks of 128 columns",
                    "run the module's own forward for this width",
                )
            )
        self.width, self.dtype, self.device = width, dtype, torch.device(device)
        bf16 = dtype == torch.bfloat16
        self._view = (lambda t: t.view(torch.int16)) if bf16 else (lambda t: t)
        dummy = torch.empty(1, dtype=torch.uint8, device=device)  # the codes: never written
        self._launch = Launcher(
            _silu_mul_kernel,
            ("g_ptr", "u_ptr", "y_ptr", "n_valid", "n_rows", "stride_g", "stride_u", "stride_y"),
            dict(q_ptr=dummy, qs_ptr=dummy, stride_q=0, stride_qs_r=0, stride_qs_k=0,
                 QUANT=False, BF16=bf16, BLOCK_R=_SILU_ROWS, HW=False),
            dict(num_warps=4),
        )  # fmt: skip

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        m = gate.shape[0]
        y = torch.empty_like(gate)
        if m:
            v = self._view
            grid = ((m + _SILU_ROWS - 1) // _SILU_ROWS, self.width // 128)
            self._launch(grid, v(gate), v(up), v(y), m, m, gate.stride(0), up.stride(0),
                         y.stride(0))  # fmt: skip
        return y


_SILU_ROWS = 32  # rows per program: silu_mul_fp8's default
