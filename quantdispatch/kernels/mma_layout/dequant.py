"""The mma16x64 layout dequantized to 16-bit rows: the slabs of the large-M path (cuBLAS after
it) and the expert stacks of the MoE's dequantize path. Each thread decodes one lane's 32
weights with the GEMV kernel's own PTX, rescales them in fp32 by 2^8 * global scale (one
rounding to 16-bit), and writes 2 x 32 contiguous bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common.launch import Launcher
from quantdispatch.kernels.common.ptx import decode_chunk, load_w
from quantdispatch.kernels.mma_layout.layout import TILE_N, scale_pairs

__all__ = ["DEQUANT_WARPS", "MmaDequantRows", "mma_dequant_rows"]


def _rescale_asm(bf16: bool) -> str:
    """16 A registers (16-bit pairs, e2m1 * scale * 2^-8) -> the same pairs times ``$32``
    (fp32, 2^8 * global scale), rounded once to 16-bit. $0..$15 out, $16..$31 in."""
    body = ["{", ".reg .f32 %lo, %hi;", ".reg .b16 %l16, %h16;"]
    for i in range(16):
        src, dst = f"${16 + i}", f"${i}"
        if bf16:
            body += [
                f"shl.b32 %lo, {src}, 16;",
                f"and.b32 %hi, {src}, 0xFFFF0000;",
                "mul.rn.f32 %lo, %lo, $32;",
                "mul.rn.f32 %hi, %hi, $32;",
                f"cvt.rn.bf16x2.f32 {dst}, %hi, %lo;",
            ]
        else:
            body += [
                f"mov.b32 {{%l16, %h16}}, {src};",
                "cvt.f32.f16 %lo, %l16;",
                "cvt.f32.f16 %hi, %h16;",
                "mul.rn.f32 %lo, %lo, $32;",
                "mul.rn.f32 %hi, %hi, $32;",
                f"cvt.rn.f16x2.f32 {dst}, %hi, %lo;",
            ]
    body.append("}")
    return "\n".join(body)


_RESCALE_BF16 = tl.constexpr(_rescale_asm(True))
_RESCALE_F16 = tl.constexpr(_rescale_asm(False))
_RESCALE_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 16 + ["r"] * 16 + ["f"]))


def _pair_store_asm() -> str:
    """Rows g and g + 8 (registers 0, 2, ..., 14 and 1, 3, ..., 15, in column order) stored as
    whole 32-byte sectors: lanes 2i and 2i + 1 (adjacent 16 columns of one row) swap the even
    lane's second 16 bytes with the odd lane's first, so each store instruction writes both
    halves of a sector. $1 / $2: the row pointers moved back 16 bytes on odd lanes, $3: the
    lane's parity, $4 + j: register j."""
    body = ["{", ".reg .pred %p;", ".reg .b32 %s, %v, %x<4>, %y<4>;", "setp.ne.b32 %p, $3, 0;"]
    for row, ptr in ((0, "$1"), (1, "$2")):
        for i in range(4):
            own0, own1 = f"${4 + row + 2 * i}", f"${12 + row + 2 * i}"
            body += [
                f"selp.b32 %s, {own0}, {own1}, %p;",  # odd lanes send their first half
                "shfl.sync.bfly.b32 %v, %s, 1, 0x1f, 0xffffffff;",
                f"selp.b32 %x{i}, %v, {own0}, %p;",
                f"selp.b32 %y{i}, {own1}, %v, %p;",
            ]
        body += [
            f"st.global.v4.b32 [{ptr}], {{%x0, %x1, %x2, %x3}};",
            f"st.global.v4.b32 [{ptr}+32], {{%y0, %y1, %y2, %y3}};",
        ]
    body += ["mov.b32 $0, 0;", "}"]
    return "\n".join(body)


_PAIR_STORE_ASM = tl.constexpr(_pair_store_asm())
_PAIR_STORE_CONSTRAINTS = tl.constexpr("=r,l,l,r," + ",".join(["r"] * 16))


@triton.jit
def _mma_dequant_kernel(
    w_ptr,
    s_ptr,
    gs_ptr,
    out_ptr,
    tile0,
    stride_o,
    CHUNKS: tl.constexpr,
    WARPS: tl.constexpr,
    BF16: tl.constexpr,
    SPC: tl.constexpr = 32,
):
    """Dequantize tiles tile0.. of the mma layout into 16-bit rows (the large-M path's slab):
    each thread decodes one lane's 32 weights with the GEMV kernel's own PTX, rescales them in
    fp32 by 2^8 * global scale, and writes 2 x 32 contiguous bytes (rows g and g + 8), lane
    pairs swapping halves first so that every store fills whole 32-byte sectors (why:
    docs/design/mma-layout.md). Element i of the program's vectors is lane i % 32 of warp
    i // 32 (one element per thread), which the swap relies on."""
    tile = tile0 + tl.program_id(1)
    idx = tl.arange(0, 32 * WARPS)
    lane = idx % 32
    c = tl.program_id(0) * WARPS + idx // 32
    ok = c < CHUNKS
    cc = tl.minimum(c, CHUNKS - 1)
    w = w_ptr + (tile.to(tl.int64) * CHUNKS + cc) * 128 + lane * 4
    s_lane = lane if SPC == 32 else lane // 2  # MXFP4: lanes 2i and 2i + 1 share scale pair i
    s = s_ptr + (tile.to(tl.int64) * CHUNKS + cc) * SPC + s_lane
    # chunks past the end (last program) re-decode the last chunk and store the same values
    q0, q1, q2, q3, u = load_w(w, s, ok, True)
    a = decode_chunk(q0, q1, q2, q3, u, BF16)
    factor = tl.load(gs_ptr) * 256.0 + tl.zeros((32 * WARPS,), dtype=tl.float32)
    r = tl.inline_asm_elementwise(
        _RESCALE_BF16 if BF16 else _RESCALE_F16,
        _RESCALE_CONSTRAINTS,
        [
            a[0],
            a[1],
            a[2],
            a[3],
            a[4],
            a[5],
            a[6],
            a[7],
            a[8],
            a[9],
            a[10],
            a[11],
            a[12],
            a[13],
            a[14],
            a[15],
            factor,
        ],
        dtype=(tl.int32,) * 16,
        is_pure=True,
        pack=1,
    )
    row = (tile - tile0) * 16 + lane // 4
    col = cc * 64 + 16 * (lane % 4)
    p_lo = out_ptr + row.to(tl.int64) * stride_o + col
    p_lo -= 8 * (lane % 2)  # odd lanes store the sector's second half first: 16 bytes back
    tl.inline_asm_elementwise(
        _PAIR_STORE_ASM,
        _PAIR_STORE_CONSTRAINTS,
        [
            p_lo,
            p_lo + 8 * stride_o,
            lane % 2,
            r[0],
            r[1],
            r[2],
            r[3],
            r[4],
            r[5],
            r[6],
            r[7],
            r[8],
            r[9],
            r[10],
            r[11],
            r[12],
            r[13],
            r[14],
            r[15],
        ],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


class MmaDequantRows:
    """:func:`mma_dequant_rows` over one weight with the launch bound once (the slabs of a
    bound large-M linear): ``rows(a, b, out)``, ``out`` in the dtype the layout was packed
    for."""

    def __init__(
        self,
        words: torch.Tensor,
        scales: torch.Tensor,
        global_scale: torch.Tensor,
        warps: int | None = None,
    ) -> None:
        self._chunks = words.shape[1]
        self._warps = warps or DEQUANT_WARPS
        self._fixed = dict(
            w_ptr=words, s_ptr=scales.view(torch.int16), gs_ptr=global_scale,
            CHUNKS=self._chunks, WARPS=self._warps, SPC=scale_pairs(scales),
        )  # fmt: skip
        self._launchers: dict[torch.dtype, Launcher] = {}

    def _launcher(self, dtype: torch.dtype) -> Launcher:
        launcher = self._launchers[dtype] = Launcher(
            _mma_dequant_kernel,
            ("out_ptr", "tile0", "stride_o"),
            dict(self._fixed, BF16=dtype == torch.bfloat16),
            dict(num_warps=self._warps),
        )
        return launcher

    def __call__(self, row_a: int, row_b: int, out: torch.Tensor) -> torch.Tensor:
        if row_a % TILE_N or row_b % TILE_N:
            raise ValueError(f"rows {row_a}..{row_b} are not whole {TILE_N}-row tiles")
        launch = self._launchers.get(out.dtype) or self._launcher(out.dtype)
        grid = (triton.cdiv(self._chunks, self._warps), (row_b - row_a) // TILE_N)
        launch(grid, out, row_a // TILE_N, out.stride(0))
        return out


#: Warps per program of the dequantize kernel (one 64-wide K chunk per warp of one 16-row tile);
#: the counts benchmarks/probes/dequant_sweep.py --mma tries time alike.
DEQUANT_WARPS = 4


def mma_dequant_rows(
    words: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    row_a: int,
    row_b: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Rows ``row_a .. row_b`` (multiples of 16) of the weight, dequantized into ``out``
    [row_b - row_a, K] (bf16 or fp16, the dtype the layout was packed for)."""
    return MmaDequantRows(words, scales, global_scale)(row_a, row_b, out)
