"""NVFP4 weight-only GEMM for small M on tensor cores, with the decode written in PTX.

Why this exists: the tl.dot kernels in :mod:`.fp4_linear` spend ~6 instructions per weight
(static SASS count, benchmarks/NOTES.md) on decode, layout moves and byte extraction, which
makes them instruction-issue bound at ~1.5 TB/s on the H200 (the budget at the 4.2 TB/s
floor is ~4.4 per weight). Here the weights are repacked once (``prepare``, same bytes) so that
each lane of a warp loads its ``mma.m16n8k16`` A fragments for 64 K with one 16-byte load,
and turns every 32-bit word (8 codes) into the four 16-bit A registers with 11 integer ops
(no byte extraction, no conversion), one 16-bit FMA per two weights for the block scale, then
``mma.sync`` with the activations as the 8-column B operand. Everything per lane is inline PTX
inside a Triton program whose tensors hold exactly one element per thread, so Triton only
launches, loops and reduces across warps: the kernel needs nothing but torch and triton.

Layout ("mma16x64"; N a multiple of 16, K of 64), for tile ``T`` (rows 16T..16T+15), chunk
``c`` (K columns 64c..64c+63) and lane ``l = 4g + t``:

* ``words[T, c, l, j]`` (int32, j = 0..3): the 8 codes of rows 16T+g and 16T+g+8 at K
  columns ``64c + 16t + 4j + {0, 1, 2, 3}``. Within each word the code bits sit where the
  decode table below reads them (:data:`DECODE_TABLES`), so that a rotate and a mask (two
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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quantdispatch.errors import WeightFormatError, format_error

__all__ = [
    "DECODE_TABLES",
    "LAYOUT",
    "decode_emulated",
    "encode_mx_scales",
    "encode_scales",
    "mma_dequant_rows",
    "mma_linear",
    "mma_supported_shape",
    "repack",
    "repack_mx",
    "unpack",
]

LAYOUT = "mma16x64"
TILE_N = 16
CHUNK_K = 64
MAX_TOKENS_PER_PROGRAM = 64  # 8 MMA column tiles of 8 tokens


@dataclass(frozen=True)
class DecodeTable:
    """Where a 16-bit format wants an E2M1 code, and how each A register is extracted.

    ``sign_bit`` / ``mag_top`` are the bit positions (low half) of the sign and of the top
    magnitude bit (e1; then e0, m below it) in the 16-bit pattern whose value is
    ``e2m1 * 2^-bias_log2``. ``rotations[r] = (a, b)``: register r is
    ``(rotl(q, a) & SIGN) | (rotl(q, b) & MAG)`` (one rotate + mask when a == b).
    """

    sign_bit: int
    mag_top: int
    rotations: tuple[tuple[int, int], ...]

    @property
    def sign_mask(self) -> int:
        return (1 << self.sign_bit) | (1 << (self.sign_bit + 16))

    @property
    def mag_mask(self) -> int:
        low = 0b111 << (self.mag_top - 2)
        return low | (low << 16)

    def positions(self, reg: int, half: int) -> tuple[int, tuple[int, int, int]]:
        """Word bit positions of (sign, (e1, e0, m)) of the code in register ``reg``, ``half``."""
        a, b = self.rotations[reg]
        sign = (self.sign_bit + 16 * half - a) % 32
        mag = tuple((self.mag_top - i + 16 * half - b) % 32 for i in range(3))
        return sign, mag  # type: ignore[return-value]


# Found by exhaustive search over rotate/mask decodes (11 ops per word for both; four rotate +
# mask registers cannot tile 32 bits for either pattern).
DECODE_TABLES: dict[torch.dtype, DecodeTable] = {
    torch.bfloat16: DecodeTable(
        sign_bit=15, mag_top=8, rotations=((0, 1), (15, 10), (4, 4), (14, 14))
    ),
    torch.float16: DecodeTable(
        sign_bit=15, mag_top=11, rotations=((0, 4), (15, 7), (1, 1), (14, 14))
    ),
}


def _check_tables() -> None:
    for dtype, table in DECODE_TABLES.items():
        seen = sorted(
            p
            for r in range(4)
            for h in range(2)
            for p in (table.positions(r, h)[0], *table.positions(r, h)[1])
        )
        if seen != list(range(32)):  # pragma: no cover - a broken table is a programming error
            raise AssertionError(f"decode table for {dtype} does not tile a 32-bit word")


_check_tables()

# register r holds rows (g, g+8)[r % 2], columns 4j + 2 * (r // 2) + {0, 1}
_REG_ROW = (0, 1, 0, 1)
_REG_COL = (0, 0, 2, 2)

# e4m3 subnormal mantissa (value mm * 2^-9) -> u = ((E + 9) << 3) | m
_SUBNORMAL_U = (0, 0, 8, 12, 16, 18, 20, 22)


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
    table = torch.tensor(_SUBNORMAL_U, dtype=torch.int32, device=b.device)
    normal = (b >> 3) > 0
    u = torch.where(normal, b + 16, table[(b & 7).long()])
    return u.to(torch.uint8)


def _decode_scales(u: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_scales` for non-zero scales (u -> e4m3 code)."""
    u = u.to(torch.int32)
    e = (u >> 3) - 9  # value 2^e (1 + m/8)
    normal = e >= -6
    code_normal = u - 16
    inv = {v: i for i, v in enumerate(_SUBNORMAL_U) if i > 0}
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


def _scale_pairs(scales: torch.Tensor) -> int:
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
            code = c7[..., _REG_ROW[r], _REG_COL[r] + h].to(torch.int64)
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
    if _scale_pairs(scales) != 32:
        raise ValueError("unpack takes NVFP4 mma16x64 layouts (32 scale pairs per tile and chunk)")
    table = DECODE_TABLES[act_dtype]
    tiles, chunks = words.shape[0], words.shape[1]
    codes = _word_codes(words.reshape(tiles, chunks, 8, 4, 4), table)  # [T, c, g, t, j, r, h]
    full = torch.zeros(tiles, chunks, 8, 4, 4, 2, 4, dtype=torch.int64, device=words.device)
    for r in range(4):
        for h in range(2):
            full[..., _REG_ROW[r], _REG_COL[r] + h] = codes[..., r, h]
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
    if _scale_pairs(scales) == 16:  # MXFP4: lanes 4g + 2h + {0, 1} read pair 2g + h
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
            full[..., _REG_ROW[r], _REG_COL[r] + h] = v * scale[..., _REG_ROW[r]][..., None]
    full = full.permute(0, 5, 2, 1, 3, 4, 6).reshape(tiles * 16, chunks * 64)
    return full


# --------------------------------------------------------------------------------------------
# PTX pieces (one Triton element per thread: each asm block is one lane's work)
# --------------------------------------------------------------------------------------------


def _bits(mask: int) -> list[int]:
    return [p for p in range(32) if mask >> p & 1]


def _shift_ptx(dst: str, word: str, n: int, mask: int, fma_shifts: bool) -> str:
    """``rotl(word, n)`` as seen through ``mask``. With ``fma_shifts``, a plain left shift when
    no masked bit comes from the wrapped-around top (ptxas then issues it on the FMA pipe as
    IMAD.SHL, leaving the integer ALU pipe, which the decode keeps busiest, for the rest), else
    a rotate."""
    if fma_shifts and all(p >= n for p in _bits(mask)):
        return f"shl.b32 {dst}, {word}, {n};"
    return f"shf.l.wrap.b32 {dst}, {word}, {word}, {n};"


def _decode_ptx(table: DecodeTable, word: str, outs: list[str], *, fma_shifts: bool = False) -> str:
    """PTX turning the 32-bit ``word`` into the four A registers ``outs`` (before scaling).

    ``fma_shifts``: non-wrapping shifts as ``shl`` (IMAD.SHL on the FMA pipe). Measured on the
    H200 (NOTES, session 11): faster in the mma.sync GEMV, whose integer ALU pipe is the busiest
    (gate_up M=1 20.8 vs 22.1 us, down 12.3 vs 13.3), but slower in the wgmma GEMM, where each
    step waits for its decode and IMAD.SHL's longer latency shows (qkv M=128 29.7 vs 25.1)."""
    lines = []
    both = table.sign_mask | table.mag_mask
    for r, out in enumerate(outs):
        a, b = table.rotations[r]
        src_s = word if a == 0 else f"%rs{r}"
        src_m = word if b == 0 else f"%rm{r}"
        if a and a != b:
            lines.append(_shift_ptx(f"%rs{r}", word, a, table.sign_mask, fma_shifts))
        if b:
            mask = both if a == b else table.mag_mask
            lines.append(_shift_ptx(f"%rm{r}", word, b, mask, fma_shifts))
        if a == b:
            lines.append(f"and.b32 {out}, {src_m}, {table.sign_mask | table.mag_mask};")
        else:
            lines.append(f"and.b32 %rm{r}, {src_m}, {table.mag_mask};")
            # (src_s & SIGN) | rm : lut (a & c) | b with a=src_s, b=rm, c=SIGN -> 0xEC
            lines.append(f"lop3.b32 {out}, {src_s}, %rm{r}, {table.sign_mask}, 0xEC;")
    return "\n".join(lines)


def _decode_asm(bf16: bool) -> str:
    """One chunk of one lane: 4 words + 2 scale codes -> 16 scaled A registers.

    Operands: $0..$15 the A registers (step j, register r at 4j + r), $16..$19 the words,
    $20 the two scale codes (row g in bits 0..7, row g+8 in bits 8..15)."""
    table = DECODE_TABLES[torch.bfloat16 if bf16 else torch.float16]
    mul = 0x00100010 if bf16 else 0x00800080
    add = ((236 << 7) | (236 << 23)) if bf16 else ((12 << 10) | (12 << 26))
    fma = "fma.rn.bf16x2" if bf16 else "fma.rn.f16x2"
    body = [
        "{",
        ".reg .b32 %rs<4>, %rm<4>, %su, %sg, %sg8, %neg0;",
        "mov.b32 %neg0, 0x80008000;",
        "and.b32 %su, $20, 255;",
        f"mad.lo.u32 %sg, %su, {mul}, {add};",
        "shr.u32 %su, $20, 8;",
        "and.b32 %su, %su, 255;",
        f"mad.lo.u32 %sg8, %su, {mul}, {add};",
    ]
    for j in range(4):
        regs = [f"${4 * j + r}" for r in range(4)]
        body.append(_decode_ptx(table, f"${16 + j}", regs, fma_shifts=True))
        for r in range(4):
            s = "%sg" if _REG_ROW[r] == 0 else "%sg8"
            body.append(f"{fma} {regs[r]}, {regs[r]}, {s}, %neg0;")
    body.append("}")
    return "\n".join(body)


_MMA_PTX = (
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
    "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
)
_DECODE_BF16 = tl.constexpr(_decode_asm(True))
_DECODE_F16 = tl.constexpr(_decode_asm(False))
_MMA_BF16 = tl.constexpr(_MMA_PTX)
_MMA_F16 = tl.constexpr(_MMA_PTX.replace("bf16", "f16"))
_MMA_CONSTRAINTS = tl.constexpr("=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")


_LOAD_W_ASM = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $5, 0;\n"
    "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; mov.b32 $4, 0;\n"
    "@p ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$6];\n"
    "@p ld.global.nc.L1::no_allocate.u16 $4, [$7]; }"
)
_LOAD_W_ASM_ALL = tl.constexpr(
    "ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$6];\n"
    "ld.global.nc.L1::no_allocate.u16 $4, [$7];"
)
_LOAD_X_ASM_ALL = tl.constexpr(
    "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$9];\nld.global.nc.v4.b32 {$4, $5, $6, $7}, [$9+16];"
)
_LOAD_X_ASM = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $8, 0;\n"
    "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;\n"
    "mov.b32 $4, 0; mov.b32 $5, 0; mov.b32 $6, 0; mov.b32 $7, 0;\n"
    "@p ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$9];\n"
    "@p ld.global.nc.v4.b32 {$4, $5, $6, $7}, [$9+16]; }"
)


@triton.jit
def _load_w(w_ptrs, s_ptrs, ok, ALL: tl.constexpr):
    """A lane's 16 bytes of codes and its 2 scale codes for one chunk (zeros where not ok;
    ALL: every chunk exists, no predicate)."""
    return tl.inline_asm_elementwise(
        _LOAD_W_ASM_ALL if ALL else _LOAD_W_ASM,
        "=r,=r,=r,=r,=r,r,l,l",
        [ok.to(tl.int32), w_ptrs, s_ptrs],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _load_x(x_ptrs, ok, ALL: tl.constexpr):
    """A lane's B fragments for one chunk: 32 contiguous bytes of one activation row."""
    return tl.inline_asm_elementwise(
        _LOAD_X_ASM_ALL if ALL else _LOAD_X_ASM,
        "=r,=r,=r,=r,=r,=r,=r,=r,r,l",
        [ok.to(tl.int32), x_ptrs],
        dtype=(tl.int32,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _decode_chunk(q0, q1, q2, q3, u, BF16: tl.constexpr):
    return tl.inline_asm_elementwise(
        _DECODE_BF16 if BF16 else _DECODE_F16,
        "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r",
        [q0, q1, q2, q3, u],
        dtype=(tl.int32,) * 16,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _mma(acc0, acc1, acc2, acc3, a0, a1, a2, a3, b0, b1, BF16: tl.constexpr):
    return tl.inline_asm_elementwise(
        _MMA_BF16 if BF16 else _MMA_F16,
        _MMA_CONSTRAINTS,
        [a0, a1, a2, a3, b0, b1, acc0, acc1, acc2, acc3],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _mma_step(acc0, acc1, acc2, acc3, a, J: tl.constexpr, b0, b1, BF16: tl.constexpr):
    """MMA step J of a chunk: A registers 4J..4J+3 (one per thread, broadcast over the token
    tiles), B fragments (b0, b1) per token tile."""
    return _mma(
        acc0,
        acc1,
        acc2,
        acc3,
        a[4 * J][:, None, :],
        a[4 * J + 1][:, None, :],
        a[4 * J + 2][:, None, :],
        a[4 * J + 3][:, None, :],
        b0,
        b1,
        BF16,
    )


@triton.jit
def _mma_step_tiles(acc0, acc1, acc2, acc3, a, J: tl.constexpr, b0, b1, BF16: tl.constexpr):
    """MMA step J for R tiles at once: A registers [R, U, 32W] (broadcast over the token tiles),
    B fragments [U, NT, 32W] (broadcast over the R tiles: loaded once, used R times)."""
    return _mma(
        acc0,
        acc1,
        acc2,
        acc3,
        a[4 * J][:, :, None, :],
        a[4 * J + 1][:, :, None, :],
        a[4 * J + 2][:, :, None, :],
        a[4 * J + 3][:, :, None, :],
        b0[None, :, :, :],
        b1[None, :, :, :],
        BF16,
    )


@triton.jit
def _tile_sum(acc, R: tl.constexpr, NT: tl.constexpr, WK: tl.constexpr, WT: tl.constexpr):
    """[R, U, NT, WK * WT * 32] partial sums -> [R, NT, WT * 32] (chunks in flight, K split)."""
    return tl.sum(tl.reshape(tl.sum(acc, axis=1), (R, NT, WK, WT * 32)), axis=2)


@triton.jit(do_not_specialize=["M"])
def _mma_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_om,
    CHUNKS: tl.constexpr,
    NT: tl.constexpr,
    WT: tl.constexpr,
    WK: tl.constexpr,
    UNROLL: tl.constexpr,
    R: tl.constexpr,
    BF16: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DEPTH: tl.constexpr = 1,
    SPC: tl.constexpr = 32,
):
    """One program = WT * R 16-row tiles x (8 * NT) tokens with WT * WK warps: warp (wt, wk)
    takes R consecutive tiles and every WK-th chunk from wk (a K split summed at the end). Its
    activation fragments are loaded once per chunk and used by all R tiles (at M >= 16 the
    activation loads, not the weights, fill L1: ncu on the H200 shows L1 ~72% busy at M = 16
    and 64 with R = 1); the WT warps of one wk read the same activation bytes at about the same
    time, so those loads hit in L1. Each step a warp handles UNROLL chunks (wk + WK * i), and
    the weight loads of the step DEPTH steps ahead are issued before this step's math, so every
    warp keeps DEPTH * R * UNROLL * 576 bytes in flight (DEPTH = 2 costs another set of
    weight registers, for latency-bound calls with registers to spare).

    Tensor shapes (one element per thread along the last axis, 32 * WARPS): per-lane values
    [32W]; weights per tile and chunk [R, U, 32W]; activations per chunk and token tile
    [U, NT, 32W]; accumulators [R, U, NT, 32W].

    SPC: scale pairs per tile and chunk, 32 (NVFP4: one per lane) or 16 (MXFP4, group 32: lanes
    2i and 2i + 1 read the same pair, see :func:`repack_mx`)."""
    WARPS: tl.constexpr = WT * WK
    m0 = tl.program_id(0) * (8 * NT)
    idx = tl.arange(0, 32 * WARPS)
    lane = idx % 32
    warp = idx // 32
    tile = ((tl.program_id(1) * WT + warp % WT) * R).to(tl.int64)  # first tile of the warp
    wk = warp // WT
    g = lane // 4
    t = lane % 4
    # token rows of this lane's B fragments: past M they repeat row M - 1 (their output columns
    # are never stored, and a repeated row is the same cache line for the whole warp)
    tt = tl.arange(0, NT)[:, None]
    rows = tl.minimum(m0 + 8 * tt + g[None, :], M - 1).to(tl.int64)
    x_row = (x_ptr + rows * stride_xm + (16 * t)[None, :])[None, :, :]  # [1, NT, 32W]
    rr = tl.arange(0, R)[:, None, None]
    w_base = w_ptr + (tile[None, None, :] + rr) * (CHUNKS * 128) + (lane * 4)[None, None, :]
    s_lane = lane if SPC == 32 else lane // 2  # MXFP4: lanes 2i and 2i + 1 share scale pair i
    s_base = s_ptr + (tile[None, None, :] + rr) * (CHUNKS * SPC) + s_lane[None, None, :]
    cx = tl.arange(0, UNROLL)[:, None] * WK + wk[None, :]  # [U, 32W] chunk of each slot
    cw = cx[None, :, :]  # [1, U, 32W]
    STEP: tl.constexpr = WK * UNROLL
    acc0 = tl.zeros((R, UNROLL, NT, 32 * WARPS), dtype=tl.float32)
    acc1 = tl.zeros((R, UNROLL, NT, 32 * WARPS), dtype=tl.float32)
    acc2 = tl.zeros((R, UNROLL, NT, 32 * WARPS), dtype=tl.float32)
    acc3 = tl.zeros((R, UNROLL, NT, 32 * WARPS), dtype=tl.float32)
    # EVEN (CHUNKS a multiple of STEP): no predicates; the prefetch past the end re-reads the
    # last chunk instead of reading out of bounds
    EVEN: tl.constexpr = CHUNKS % STEP == 0
    every_tile = rr >= 0  # [R, 1, 1]: broadcasts the chunk masks over the tiles
    q0, q1, q2, q3, u = _load_w(
        w_base + cw * 128, s_base + cw * SPC, (cw < CHUNKS) & every_tile, EVEN
    )
    if DEPTH == 2:  # the second step's weights, in flight with the first's
        c1 = tl.minimum(cw + STEP, CHUNKS - 1) if EVEN else cw + STEP
        p0, p1, p2, p3, pu = _load_w(
            w_base + c1 * 128, s_base + c1 * SPC, (c1 < CHUNKS) & every_tile, EVEN
        )
    for c0 in range(0, CHUNKS, STEP):
        c = c0 + cw
        nxt = tl.minimum(c + DEPTH * STEP, CHUNKS - 1) if EVEN else c + DEPTH * STEP
        n0, n1, n2, n3, nu = _load_w(
            w_base + nxt * 128, s_base + nxt * SPC, (nxt < CHUNKS) & every_tile, EVEN
        )
        ok = (c0 + cx < CHUNKS)[:, None, :]
        x0, x1, x2, x3, x4, x5, x6, x7 = _load_x(x_row + ((c0 + cx) * 64)[:, None, :], ok, EVEN)
        a = _decode_chunk(q0, q1, q2, q3, u, BF16)
        acc0, acc1, acc2, acc3 = _mma_step_tiles(acc0, acc1, acc2, acc3, a, 0, x0, x1, BF16)
        acc0, acc1, acc2, acc3 = _mma_step_tiles(acc0, acc1, acc2, acc3, a, 1, x2, x3, BF16)
        acc0, acc1, acc2, acc3 = _mma_step_tiles(acc0, acc1, acc2, acc3, a, 2, x4, x5, BF16)
        acc0, acc1, acc2, acc3 = _mma_step_tiles(acc0, acc1, acc2, acc3, a, 3, x6, x7, BF16)
        if DEPTH == 2:
            q0, q1, q2, q3, u = p0, p1, p2, p3, pu
            p0, p1, p2, p3, pu = n0, n1, n2, n3, nu
        else:
            q0, q1, q2, q3, u = n0, n1, n2, n3, nu
    r0 = _tile_sum(acc0, R, NT, WK, WT)
    r1 = _tile_sum(acc1, R, NT, WK, WT)
    r2 = _tile_sum(acc2, R, NT, WK, WT)
    r3 = _tile_sum(acc3, R, NT, WK, WT)
    lt = tl.arange(0, WT * 32)[None, None, :]  # (warp within the program, lane)
    l32 = lt % 32
    tok = m0 + 8 * tl.arange(0, NT)[None, :, None] + 2 * (l32 % 4)  # [1, NT, WT * 32]
    n_lo = ((tl.program_id(1) * WT + lt // 32) * R + rr) * 16 + l32 // 4  # [R, 1, WT * 32]
    factor = tl.load(gs_ptr) * 256.0
    _store_out(out_ptr, bias_ptr, r0, tok, n_lo, M, stride_om, factor, HAS_BIAS)
    _store_out(out_ptr, bias_ptr, r1, tok + 1, n_lo, M, stride_om, factor, HAS_BIAS)
    _store_out(out_ptr, bias_ptr, r2, tok, n_lo + 8, M, stride_om, factor, HAS_BIAS)
    _store_out(out_ptr, bias_ptr, r3, tok + 1, n_lo + 8, M, stride_om, factor, HAS_BIAS)


@triton.jit
def _store_out(out_ptr, bias_ptr, acc, tok, n, M, stride_om, factor, HAS_BIAS: tl.constexpr):
    y = acc * factor
    if HAS_BIAS:
        y += tl.load(bias_ptr + n)
    tl.store(
        out_ptr + tok.to(tl.int64) * stride_om + n, y.to(out_ptr.dtype.element_ty), mask=tok < M
    )


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
# row g: registers 0, 2, 4, ..., 14 in column order; row g + 8: 1, 3, ..., 15
_STORE_ROWS_CONSTRAINTS = tl.constexpr("=r,l,l," + ",".join(["r"] * 16))
_STORE_ROWS_ASM = tl.constexpr(
    "st.global.v4.b32 [$1], {$3, $5, $7, $9};\n"
    "st.global.v4.b32 [$1+16], {$11, $13, $15, $17};\n"
    "st.global.v4.b32 [$2], {$4, $6, $8, $10};\n"
    "st.global.v4.b32 [$2+16], {$12, $14, $16, $18};\n"
    "mov.b32 $0, 0;"
)


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
    fp32 by 2^8 * global scale, and writes 2 x 32 contiguous bytes (rows g and g + 8)."""
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
    q0, q1, q2, q3, u = _load_w(w, s, ok, True)
    a = _decode_chunk(q0, q1, q2, q3, u, BF16)
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
    p_hi = p_lo + 8 * stride_o
    tl.inline_asm_elementwise(
        _STORE_ROWS_ASM,
        _STORE_ROWS_CONSTRAINTS,
        [
            p_lo,
            p_hi,
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


# --------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------


def _base_config(tiles: int, chunks: int, m: int) -> tuple[int, int, int, int, int]:
    """(NT, WT, WK, UNROLL, R) with one step of weight loads in flight (the checkpoint-layout
    kernel's configs too, :func:`.fp4_mma_ckpt.linear_config`): token tiles per program from
    M; warps side by side (activation reuse through L1); K split; chunks in flight per warp;
    tiles per warp (activation reuse in registers). From the H200 sweeps (benchmarks/results/
    mma-sweep-h200-*.log; R from the ``-tiles`` one: it pays only with 64+ tokens per program,
    e.g. gate_up M=64 100 vs 132 us, M=128 156 vs 193 us, down M=128 88 vs 118 us)."""
    nt = 1
    while nt * 8 < min(m, MAX_TOKENS_PER_PROGRAM):
        nt *= 2
    big = tiles >= 1024  # e.g. a fused 28672-row gate_up: enough programs without a K split
    r = 1
    if nt == 1:  # gate_up M <= 8: 2x2x2 19.6-19.8 vs 1x4x2 21.3-23.1 us (-gate_up-m1-8.log)
        wt, wk, unroll = (2, 2, 2) if big else ((1, 8, 4) if chunks >= 128 else (1, 8, 2))
    elif nt == 2:  # mma-sweep-h200-2026-11-30-{l2prefetch,decode-shl}.log, two builds agree
        if big:  # gate_up M=16: 2x2x2x2 29.7 / 28.0 vs 8x2x1 30.8 / 30.1 us
            wt, wk, unroll, r = 2, 2, 2, 2
        else:  # qkv M=16: 1x4x2 10.6 / 10.9 vs 1x8x2 11.6 / 11.9; o keeps 1x8x2 (9.2 vs 9.7)
            wt, wk, unroll = (1, 4, 2) if tiles >= 384 else (1, 8, 2)
    elif nt == 4:
        wt, wk, unroll = (8, 1, 2) if big else (1, 4, 2)
    elif big:
        wt, wk, unroll, r = (8, 1, 1, 2) if m <= 64 else (4, 1, 1, 4)
    elif m > 64 and chunks >= 128:  # a long-K weight (down) at two token blocks
        wt, wk, unroll, r = 1, 4, 2, 2
    else:
        wt, wk, unroll = (4, 2, 2) if tiles >= 384 else (2, 4, 2)
    return (nt, *_fit(tiles, chunks, wt, wk, r, unroll))


def _fit(tiles: int, chunks: int, wt: int, wk: int, r: int, unroll: int) -> tuple[int, ...]:
    """(WT, WK, UNROLL, R) shrunk to the weight: a K split no larger than the chunks (a power of
    two, Triton's num_warps) and WT * R dividing the row tiles (the grid is whole)."""
    while wk > 1 and wk > chunks:
        wk //= 2
    while r > 1 and tiles % r:
        r //= 2
    while wt > 1 and tiles % (wt * r):
        wt //= 2
    return wt, wk, unroll, r


def _config(tiles: int, chunks: int, m: int) -> tuple[int, int, int, int, int, int]:
    """(NT, WT, WK, UNROLL, R, DEPTH) for a call: :func:`_base_config`, except that from 9
    tokens on, weights that are not wide keep two steps of weight loads in flight (DEPTH 2) in
    narrower programs. At those M the kernel waits on memory: Nsight Compute on down M=16
    showed 0.6 eligible warps per scheduler, long-scoreboard the top stall, and only 256
    programs for 132 SMs (stall-mma-down-16). On the H200 (mma-sweep-h200-2026-11-30-depth
    logs, two sweeps each): M=16 qkv 1x4x2 10.6-10.8 -> 1x4x2d2 9.4-9.6 us, o 1x8x2 9.0-9.1 ->
    1x4x4d2 7.9-8.0, down 1x8x2 18.6-18.9 -> 1x8x2d2 16.8-16.9; M=24 / 32 qkv 1x4x2 16.2 /
    17.1-17.4 -> 1x2x4d2 14.3-14.5 / 15.1-15.4, o 13.0-13.3 / 13.6-13.9 -> 11.7-12.1 /
    12.2-12.5 (down at M=24: 1x4x4d2 24.6 vs 32.0). Not at M <= 8 (no gain) nor for fused
    gate_up weights (slower: 2x2x2x2d2 33.0 vs 28.0 at M=16)."""
    nt, wt, wk, unroll, r = _base_config(tiles, chunks, m)
    if tiles < 1024 and nt in (2, 4):
        if nt == 2:
            long_k = chunks >= 128
            wt, wk, unroll = (1, 4, 2) if tiles >= 384 else ((1, 8, 2) if long_k else (1, 4, 4))
        else:
            wt, wk, unroll = (1, 4, 4) if chunks >= 128 else (1, 2, 4)
        return (nt, *_fit(tiles, chunks, wt, wk, 1, unroll), 2)
    return nt, wt, wk, unroll, r, 1


def mma_linear(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a weight in the mma layout; x [M, K] fp16/bf16, out [M, N].

    Any M works (programs of up to 64 tokens side by side; the weight tile stays in L2 for
    the programs that share it), but it is meant for small M: the backend sends large M to
    dequantize + cuBLAS. ``config`` = (NT, WT, WK, UNROLL[, R[, DEPTH]]) overrides the
    heuristic (tuning); WT * R must divide N/16."""
    tiles, chunks = words.shape[0], words.shape[1]
    n = tiles * TILE_N
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(0) % 8 or x.data_ptr() % 16 or x.stride(1) != 1:  # 16-byte loads of x rows
        x = x.clone(memory_format=torch.contiguous_format)
    nt, wt, wk, unroll, r, depth = (*(config or _config(tiles, chunks, m)), 1, 1)[:6]
    if depth not in (1, 2):
        raise ValueError(
            f"DEPTH={depth}: the weight prefetch depth is 1 or 2 steps; pass 1 or 2 as the "
            f"config's sixth entry"
        )
    if tiles % (wt * r):
        raise ValueError(f"WT={wt} x R={r} does not divide the {tiles} tiles")
    grid = (triton.cdiv(m, 8 * nt), tiles // (wt * r))
    _mma_gemv_kernel[grid](
        x,
        words,
        scales.view(torch.int16),
        global_scale,
        bias if bias is not None else global_scale,
        out,
        m,
        n,
        x.stride(0),
        out.stride(0),
        CHUNKS=chunks,
        NT=nt,
        WT=wt,
        WK=wk,
        UNROLL=unroll,
        R=r,
        BF16=x.dtype == torch.bfloat16,
        HAS_BIAS=bias is not None,
        DEPTH=depth,
        SPC=_scale_pairs(scales),
        num_warps=wt * wk,
        num_stages=1,
    )
    return out


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
    if row_a % TILE_N or row_b % TILE_N:
        raise ValueError(f"rows {row_a}..{row_b} are not whole {TILE_N}-row tiles")
    chunks = words.shape[1]
    warps = 4
    grid = (triton.cdiv(chunks, warps), (row_b - row_a) // TILE_N)
    _mma_dequant_kernel[grid](
        words,
        scales.view(torch.int16),
        global_scale,
        out,
        row_a // TILE_N,
        out.stride(0),
        CHUNKS=chunks,
        WARPS=warps,
        BF16=out.dtype == torch.bfloat16,
        SPC=_scale_pairs(scales),
        num_warps=warps,
    )
    return out
