"""Where each FP4 decode wants the bits of an E2M1 code: the rotate / mask tables shared by the
PTX builders (:mod:`.ptx`) and the torch emulations of both layouts
(:func:`..mma_layout.layout.decode_emulated`,
:func:`..checkpoint_layout.mma_decode.decode_checkpoint_emulated`). No triton import.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "CHECKPOINT_TABLES",
    "DECODE_TABLES",
    "REG_COL",
    "REG_ROW",
    "SUBNORMAL_U",
    "DecodeTable",
    "reg_column",
    "reg_source",
    "scale_consts",
]


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


# rotations[i] = (sign, magnitude) left-rotations for the nibble pair (i, i + 4) of a word
CHECKPOINT_TABLES: dict[torch.dtype, DecodeTable] = {
    torch.bfloat16: DecodeTable(
        sign_bit=15, mag_top=8, rotations=((12, 6), (8, 2), (4, 30), (0, 26))
    ),
    torch.float16: DecodeTable(
        sign_bit=15, mag_top=11, rotations=((12, 9), (8, 5), (4, 1), (0, 29))
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
REG_ROW = (0, 1, 0, 1)
REG_COL = (0, 0, 2, 2)


# e4m3 subnormal mantissa (value mm * 2^-9) -> u = ((E + 9) << 3) | m
SUBNORMAL_U = (0, 0, 8, 12, 16, 18, 20, 22)


def reg_source(j: int, r: int) -> tuple[int, int]:
    """(word, nibble pair) of A register r of MMA step j: words 0, 1 are row g, 2, 3 row g+8."""
    return j // 2 + 2 * (r % 2), 2 * (j % 2) + r // 2


def reg_column(j: int, r: int, half: int) -> int:
    """Column (0..15, within the lane's 16) of the value in ``half`` of register r of step j."""
    _, pair = reg_source(j, r)
    return 8 * (j // 2) + pair + 4 * half


def scale_consts(bf16: bool) -> tuple[int, int]:
    """(multiplier, addend) turning a u code into the 16-bit pair scale * 2^118 (bf16) or
    scale * 2^6 (fp16) with one integer multiply-add (see :mod:`..mma_layout.layout`)."""
    if bf16:
        return 0x00100010, (236 << 7) | (236 << 23)
    return 0x00800080, (12 << 10) | (12 << 26)
