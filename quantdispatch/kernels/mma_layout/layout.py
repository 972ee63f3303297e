"""The mma16x64 layout of FP4 weights: repack / unpack, the scale encoding and the torch replay
of the kernels' decode. No triton import (the kernels that read it: :mod:`.gemv`,
:mod:`.dequant`, :mod:`.gemm`, the MoE modules; why the layout exists: :mod:`.gemv`).

The weights are repacked once at load (same bytes) so that each lane of a warp loads its
``mma.m16n8k16`` A fragments for 64 K with one 16-byte load and turns every 32-bit word (8
codes) into the four 16-bit A registers with 11 integer ops (no byte extraction, no
conversion) and one 16-bit FMA per two weights for the block scale.

Layout ("mma16x64"; N a multiple of 16, K of 64), for tile ``T`` (rows 16T..16T+15), chunk
``c`` (K columns 64c..64c+63) and lane ``l = 4g + t``:

* ``words[T, c, l, j]`` (int32, j = 0..3): the 8 codes of rows 16T+g and 16T+g+8 at K columns
  ``64c + 16t + 4j + {0, 1, 2, 3}``. Within each word the code bits sit where the decode table
  reads them (:data:`..common.decode_tables.DECODE_TABLES`), so that a rotate and a mask (two
  rotates for two of the four registers) put sign and magnitude straight into the 16-bit
  exponent/mantissa fields.
* ``scales[T, c, l, 0 / 1]`` (uint8): the block scales of rows 16T+g / 16T+g+8 for group
  ``4c + t``, re-encoded as ``u = ((E + 9) << 3) | m`` for the scale value ``2^E (1 + m/8)``
  (every E4M3 value, subnormals included, is such a normal number with E in -9..8), so that one
  integer multiply-add yields the scale times a power of two as a 16-bit pair. A zero scale
  zeroes its block's codes instead (the block decodes to 0 either way).
* MXFP4 (:func:`repack_mx`): the same words; ``scales[T, c, 2g + h, 0 / 1]`` for rows 16T+g /
  16T+g+8 and group ``2c + h`` (of 32), read by lanes ``4g + 2h`` and ``4g + 2h + 1``, as u
  codes of the E8M0 scale relative to the weight's largest (the rest is the global scale).

The K permutation (MMA slot 2t + i <-> logical column 16t + 4j + i) is applied identically to
the activations, so each lane's B fragments for a chunk are 32 contiguous bytes of a row of x
(two 16-byte loads), and each lane's four MMA steps of a chunk share one scale per row.

Numerics: the 16-bit A values are ``e2m1 * scale * 2^-8`` exactly (bf16: code as e2m1 * 2^-126
times scale * 2^118; fp16: e2m1 * 2^-14 times scale * 2^6, subnormal products exact), the MMA
accumulates in fp32, and ``2^8 * global_scale`` and the bias are applied to the fp32 sums.

The decode emulation (:func:`decode_emulated`) repeats the exact bit operations in torch, so
the layout contract is tested on the CPU; the kernels themselves need an SM 8.0+ GPU (PTX).
"""

from __future__ import annotations

import torch

from quantdispatch.errors import WeightFormatError, format_error
from quantdispatch.kernels.common.decode_tables import (
    DECODE_TABLES,
    REG_COL,
    REG_ROW,
    SUBNORMAL_U,
    DecodeTable,
)

__all__ = [
    "CHUNK_K",
    "LAYOUT",
    "MX_SCALE_SPAN",
    "REPACK_SLAB_ELEMENTS",
    "TILE_N",
    "decode_emulated",
    "encode_mx_scales",
    "encode_scales",
    "mma_supported_shape",
    "repack",
    "repack_mx",
    "scale_pairs",
    "unpack",
]


LAYOUT = "mma16x64"
TILE_N = 16
CHUNK_K = 64


def mma_supported_shape(n: int, k: int) -> bool:
    return n % TILE_N == 0 and k % CHUNK_K == 0 and n > 0 and k > 0


def encode_scales(block_scale_u8: torch.Tensor) -> torch.Tensor:
    """E4M3 scale codes -> the layout's u codes (any shape; uint8). 0 stays 0 (see module)."""
    b = block_scale_u8.to(torch.int32)
    if bool(((b & 0x80) != 0).any()) or bool(((b & 0x7F) == 0x7F).any()):
        raise WeightFormatError(
            format_error(
                "block scales contain negative or NaN E4M3 codes",
                "NVFP4 block scales are finite and non-negative",
                "check the checkpoint (the loaders reject these; this is a direct call)",
            )
        )
    table = torch.tensor(SUBNORMAL_U, dtype=torch.int32, device=b.device)
    normal = (b >> 3) > 0
    u = torch.where(normal, b + 16, table[(b & 7).long()])
    return u.to(torch.uint8)


def _decode_scales(u: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_scales` for non-zero scales (u -> e4m3 code)."""
    u = u.to(torch.int32)
    e = (u >> 3) - 9  # value 2^e (1 + m/8)
    normal = e >= -6
    code_normal = u - 16
    inv = {v: i for i, v in enumerate(SUBNORMAL_U) if i > 0}
    lut = torch.zeros(32, dtype=torch.int32, device=u.device)
    for v, i in inv.items():
        lut[v] = i
    code_sub = lut[torch.clamp(u, 0, 31).long()]
    return torch.where(normal, code_normal, code_sub).to(torch.uint8)


#: MXFP4 block scales (E8M0, 2^(e - 127)) are re-encoded as the layout's u codes relative to
#: the weight's largest, 2^E' with E' = e - e_max + 8, and 2^(e_max - 135) becomes the global
#: scale. u covers E' = -9..8 (the E4M3 range), so one weight's scales may span 18 binades
#: (blocks whose codes are all zero excepted); wider weights keep the checkpoint layout.
MX_SCALE_SPAN = 18


def encode_mx_scales(
    e8m0_u8: torch.Tensor, block_nonzero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """E8M0 exponent bytes [N, K/32] -> (u codes [N, K/32] uint8, global scale fp32 0-d).

    ``block_nonzero`` [N, K/32] bool: blocks with a non-zero code. All-zero blocks get u = 0
    (their products are 0 whatever the scale). Raises WeightFormatError for NaN (255) scales
    and for scales more than :data:`MX_SCALE_SPAN` binades below the weight's largest."""
    e = e8m0_u8.to(torch.int32)
    if bool((e == 255).any()):
        raise WeightFormatError(
            format_error(
                "block scales contain the E8M0 NaN code 255",
                "MXFP4 block scales are finite powers of two (codes 0..254)",
                "check the checkpoint (the loaders reject these; this is a direct call)",
            )
        )
    e_max = e_low = 127  # a weight of zeros: any scale
    if bool(block_nonzero.any()):
        e_max = int(torch.where(block_nonzero, e, torch.full_like(e, -1)).max())
        e_low = int(torch.where(block_nonzero, e, torch.full_like(e, 255)).min())
    if e_max - e_low >= MX_SCALE_SPAN:
        raise WeightFormatError(
            format_error(
                f"block scales span 2^{e_low - 127} .. 2^{e_max - 127} ({e_max - e_low + 1} "
                "binades)",
                f"the {LAYOUT} layout holds at most {MX_SCALE_SPAN} binades of MXFP4 scales per "
                "weight",
                "use the checkpoint layout for this weight (the triton backend does so itself)",
            )
        )
    u = torch.where(block_nonzero, (e - e_max + 8 + 9) << 3, torch.zeros_like(e))
    global_scale = torch.tensor(2.0 ** (e_max - 135), dtype=torch.float32, device=e.device)
    return u.to(torch.uint8), global_scale


def scale_pairs(scales: torch.Tensor) -> int:
    """Scale pairs per tile and chunk of a layout's scales: 32 (NVFP4) or 16 (MXFP4)."""
    return int(scales.shape[2])


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] packed bytes -> [N, K] codes (low nibble = even element)."""
    p = packed.to(torch.int32)
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(packed.shape[0], -1)


#: Weights are repacked in slabs of about this many elements (whole 16-row tiles), so the
#: temporaries (int32 / int64 code tensors, several bytes per weight) stay near 200 MB whatever
#: the weight's size, instead of several GB for a fused MoE or gate_up weight.
REPACK_SLAB_ELEMENTS = 2**24


def repack(
    packed: torch.Tensor, block_scale_u8: torch.Tensor, act_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint layout (packed [N, K/2] uint8, scales [N, K/16] E4M3 codes) -> the mma layout.

    Returns ``words`` int32 [N/16, K/64, 32, 4] and ``scales`` uint8 [N/16, K/64, 32, 2]: the
    same number of bytes. Runs on the tensors' device, once, at load, slab by slab
    (:data:`REPACK_SLAB_ELEMENTS`).
    """
    table = DECODE_TABLES[act_dtype]
    n, k = _check_repack_shape(packed, block_scale_u8, 16)
    tiles, chunks = n // TILE_N, k // CHUNK_K
    u = encode_scales(block_scale_u8)  # [N, K/16]; checks every scale once
    words = torch.empty((tiles, chunks, 32, 4), dtype=torch.int32, device=packed.device)
    scales = torch.empty((tiles, chunks, 32, 2), dtype=torch.uint8, device=packed.device)
    rows = max(TILE_N, REPACK_SLAB_ELEMENTS // k // TILE_N * TILE_N)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        t0, t1 = r0 // TILE_N, r1 // TILE_N
        zero_blocks = block_scale_u8[r0:r1] == 0  # their codes are dropped (module doc)
        words[t0:t1], scales[t0:t1] = _repack_slab(packed[r0:r1], u[r0:r1], table, zero_blocks)
    return words, scales


def _check_repack_shape(packed: torch.Tensor, scales: torch.Tensor, group: int) -> tuple[int, int]:
    """(N, K) of a checkpoint weight the layout can take (scales [N, K/group]), or the error."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if not mma_supported_shape(n, k) or scales.shape != (n, k // group):
        raise WeightFormatError(
            format_error(
                f"weight {n}x{k} with scales {tuple(scales.shape)}",
                f"the {LAYOUT} layout needs N % {TILE_N} == 0, K % {CHUNK_K} == 0 and scales "
                f"[N, K/{group}]",
                "use the checkpoint layout for this weight (the triton backend does so itself)",
            )
        )
    return n, k


def repack_mx(
    packed: torch.Tensor, e8m0_u8: torch.Tensor, act_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP4 checkpoint layout (packed [N, K/2] uint8, E8M0 bytes [N, K/32]) -> the mma layout.

    Returns ``words`` (as :func:`repack`), ``scales`` uint8 [N/16, K/64, 16, 2] and the global
    scale (fp32 0-d). Scale pair ``2g + h`` of a tile and chunk holds the u codes of rows
    16T+g / 16T+g+8 for group ``2c + h``; lanes ``4g + 2h`` and ``4g + 2h + 1`` (whose 16
    columns share that group) read it: 0.5 + 1/32 bytes per weight, the checkpoint's. Raises
    WeightFormatError where :func:`encode_mx_scales` does or the shape does not fit."""
    n, k = _check_repack_shape(packed, e8m0_u8, 32)
    table = DECODE_TABLES[act_dtype]
    rows = max(TILE_N, REPACK_SLAB_ELEMENTS // k // TILE_N * TILE_N)
    nonzero = torch.empty((n, k // 32), dtype=torch.bool, device=packed.device)
    for r0 in range(0, n, rows):  # blocks with a non-zero magnitude, slab by slab
        mag = _codes(packed[r0 : r0 + rows]) & 0x7
        nonzero[r0 : r0 + rows] = mag.reshape(mag.shape[0], k // 32, 32).amax(dim=2) > 0
    u32, global_scale = encode_mx_scales(e8m0_u8, nonzero)
    tiles, chunks = n // TILE_N, k // CHUNK_K
    words = torch.empty((tiles, chunks, 32, 4), dtype=torch.int32, device=packed.device)
    scales = torch.empty((tiles, chunks, 16, 2), dtype=torch.uint8, device=packed.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        t0, t1 = r0 // TILE_N, r1 // TILE_N
        u16 = u32[r0:r1].repeat_interleave(2, dim=1)  # the group-16 view: each code twice
        w, s = _repack_slab(packed[r0:r1], u16, table)
        words[t0:t1] = w
        # lanes 4g + t: t = 0, 1 hold group 2c, t = 2, 3 group 2c + 1 -> keep t = 0 and 2
        scales[t0:t1] = s.reshape(t1 - t0, chunks, 8, 4, 2)[:, :, :, 0::2].reshape(
            t1 - t0, chunks, 16, 2
        )
    return words, scales, global_scale


def _repack_slab(
    packed: torch.Tensor,
    u: torch.Tensor,
    table: DecodeTable,
    zero_blocks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole 16-row tiles into the layout (``u``: their encoded scales per group of 16;
    ``zero_blocks`` [N, K/16]: groups whose codes are dropped, as a zero NVFP4 scale says)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    tiles, chunks = n // TILE_N, k // CHUNK_K
    codes = _codes(packed)  # [N, K]
    if zero_blocks is not None:
        dropped = zero_blocks.repeat_interleave(16, dim=1)
        codes = torch.where(dropped, torch.zeros_like(codes), codes)
    # codes[tile, rr, g, c, t, j, cc] with row = 16 tile + 8 rr + g, col = 64c + 16t + 4j + cc
    c7 = codes.reshape(tiles, 2, 8, chunks, 4, 4, 4)
    # -> [tile, c, g, t, j, rr, cc]
    c7 = c7.permute(0, 3, 2, 4, 5, 1, 6)
    words = torch.zeros(tiles, chunks, 8, 4, 4, dtype=torch.int64, device=packed.device)
    for r in range(4):
        for h in range(2):
            code = c7[..., REG_ROW[r], REG_COL[r] + h].to(torch.int64)
            sign_pos, mag_pos = table.positions(r, h)
            words |= ((code >> 3) & 1) << sign_pos
            for i, pos in enumerate(mag_pos):  # e1, e0, m = code bits 2, 1, 0
                words |= ((code >> (2 - i)) & 1) << pos
    words = words.reshape(tiles, chunks, 32, 4)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    # scales[tile, c, lane, rr] = u[16 tile + 8 rr + g, 4c + t]
    s = u.reshape(tiles, 2, 8, chunks, 4).permute(0, 3, 2, 4, 1).reshape(tiles, chunks, 32, 2)
    return words, s


def _word_codes(words: torch.Tensor, table: DecodeTable) -> torch.Tensor:
    """int32 [..., 4] words -> codes [..., 4 (j), 4 (reg), 2 (half)]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros(*w.shape, 4, 2, dtype=torch.int64, device=w.device)
    for r in range(4):
        for h in range(2):
            sign_pos, mag_pos = table.positions(r, h)
            code = ((w >> sign_pos) & 1) << 3
            for i, pos in enumerate(mag_pos):
                code |= ((w >> pos) & 1) << (2 - i)
            out[..., r, h] = code
    return out


def unpack(
    words: torch.Tensor, scales: torch.Tensor, act_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mma layout back to (packed [N, K/2] uint8, E4M3 scale codes [N, K/16] uint8).

    Exact except inside zero-scale blocks, whose codes :func:`repack` zeroed (their values are 0
    either way). NVFP4 layouts only (MXFP4 scales are relative to the weight's largest)."""
    if scale_pairs(scales) != 32:
        raise ValueError("unpack takes NVFP4 mma16x64 layouts (32 scale pairs per tile and chunk)")
    table = DECODE_TABLES[act_dtype]
    tiles, chunks = words.shape[0], words.shape[1]
    codes = _word_codes(words.reshape(tiles, chunks, 8, 4, 4), table)  # [T, c, g, t, j, r, h]
    full = torch.zeros(tiles, chunks, 8, 4, 4, 2, 4, dtype=torch.int64, device=words.device)
    for r in range(4):
        for h in range(2):
            full[..., REG_ROW[r], REG_COL[r] + h] = codes[..., r, h]
    # [T, c, g, t, j, rr, cc] -> [T, rr, g, c, t, j, cc]
    full = full.permute(0, 5, 2, 1, 3, 4, 6).reshape(tiles * 16, chunks * 64)
    packed = (full[:, 0::2] | (full[:, 1::2] << 4)).to(torch.uint8)
    u = scales.reshape(tiles, chunks, 8, 4, 2).permute(0, 4, 2, 1, 3).reshape(tiles * 16, -1)
    return packed, _decode_scales(u)


def _bits_to(word16: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (word16.to(torch.int32) & 0xFFFF).to(torch.int16).view(dtype)


def decode_emulated(
    words: torch.Tensor, scales: torch.Tensor, act_dtype: torch.dtype
) -> torch.Tensor:
    """What the kernel's A registers hold, computed with the kernel's own bit operations.

    Returns float64 [N, K] = 16-bit(pattern) * 16-bit(scale), i.e. ``e2m1 * scale * 2^-8``
    (the epilogue multiplies by 2^8 * global_scale). For tests of the layout and the decode.
    """
    table = DECODE_TABLES[act_dtype]
    tiles, chunks = words.shape[0], words.shape[1]
    w = words.to(torch.int64).reshape(tiles, chunks, 8, 4, 4) & 0xFFFFFFFF
    bf16 = act_dtype == torch.bfloat16
    if scale_pairs(scales) == 16:  # MXFP4: lanes 4g + 2h + {0, 1} read pair 2g + h
        scales = scales.reshape(tiles, chunks, 8, 2, 2).repeat_interleave(2, dim=3)
    u = scales.to(torch.int64).reshape(tiles, chunks, 8, 4, 2)
    s_bits = u * 16 + (236 << 7) if bf16 else u * 128 + (12 << 10)
    scale = _bits_to(s_bits, act_dtype).to(torch.float64)  # [T, c, g, t, rr]

    def rotl(x: torch.Tensor, n: int) -> torch.Tensor:
        return ((x << n) | (x >> (32 - n))) & 0xFFFFFFFF if n else x

    full = torch.zeros(tiles, chunks, 8, 4, 4, 2, 4, dtype=torch.float64, device=words.device)
    for r in range(4):
        a, b = table.rotations[r]
        reg = (rotl(w, a) & table.sign_mask) | (rotl(w, b) & table.mag_mask)
        for h in range(2):
            v = _bits_to(reg >> (16 * h), act_dtype).to(torch.float64)
            full[..., REG_ROW[r], REG_COL[r] + h] = v * scale[..., REG_ROW[r]][..., None]
    full = full.permute(0, 5, 2, 1, 3, 4, 6).reshape(tiles * 16, chunks * 64)
    return full
