"""Launch configurations for the Triton GEMMs: a tuned table per GPU plus heuristic defaults.

Why a table: Triton's autotuner benchmarks and synchronizes on first call, which breaks CUDA
graph capture and costs seconds per shape. Tuning happens offline (``benchmarks/linear.py
--tune`` calls :func:`tune`) and the winners are stored as JSON beside this module
(``configs_<gpu>.json``); the call path only does a dictionary lookup.

Table layout (JSON)::

    {"version": 1, "gpus": {"NVIDIA H200": {"nvfp4": {"28672x4096": {"1": {config}, ...}}}}}

keyed by the exact ``torch.cuda.get_device_name()``, the kernel kind (``nvfp4``, ``mxfp4``,
``fp8``), the weight shape ``NxK`` and the M bucket (the smallest of :data:`M_BUCKETS` >= M).
A missing kind falls back to the ``nvfp4`` entry of the same shape (same loop structure), a
missing bucket to the nearest tuned bucket of the same regime, anything else to
:func:`heuristic_config`. Every lookup returns where its answer came from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from quantdispatch.capability import SM80_PLUS, SM90_PLUS

if TYPE_CHECKING:
    from quantdispatch.kernels.common.device_facts import DeviceFacts

__all__ = [
    "MAX_TOKENS_PER_PROGRAM",
    "M_BUCKETS",
    "SMALL_M_MAX",
    "WIDE_N_MIN",
    "GemmConfig",
    "candidate_configs",
    "fit_mma_config",
    "get_config",
    "heuristic_config",
    "load_table",
    "m_bucket",
    "mma_base_config",
    "register_table",
    "table_from_results",
    "tune",
]

M_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Up to here a call takes the small-M ("GEMV-like") path: one 16-row M tile, narrow N tiles and
# long K tiles, so the grid has many programs streaming weights; above it the large-M path.
SMALL_M_MAX = 16
#: From this many weight rows (N) up, small-M calls take wider tiles (FP8: the tiled kernel).
WIDE_N_MIN = 16384

_TABLE_DIR = Path(__file__).resolve().parent
_TABLES: dict[str, dict] = {}
_LOADED = False


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration.

    ``split`` > 0 selects the small-M kernel, which splits K ``split`` ways inside each
    program (``block_k`` is then the width of one slice); 0 selects the tiled kernel, whose
    ``group_m`` is the L2 swizzle width along M tiles. ``swap_ab`` makes the weight tile the
    MMA's A operand (the activation tile the narrow B operand).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    swap_ab: int = 0
    split: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GemmConfig:
        return cls(**{k: int(v) for k, v in d.items() if k in cls.__dataclass_fields__})


def m_bucket(m: int) -> int:
    """Smallest bucket >= m (the largest bucket for anything above it)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


def register_table(table: dict) -> None:
    """Merge a table (the JSON layout above) into the in-process tables, newest wins. The
    tables shipped beside this module are loaded first, so a table registered (or loaded) by
    hand always wins over them, whether or not a lookup happened before."""
    _ensure_loaded()
    if table.get("version") != 1:
        raise ValueError(f"config table version {table.get('version')!r} is not 1")
    for gpu, kinds in table.get("gpus", {}).items():
        dst = _TABLES.setdefault(gpu, {})
        for kind, shapes in kinds.items():
            for shape, buckets in shapes.items():
                dst.setdefault(kind, {}).setdefault(shape, {}).update(buckets)


def load_table(path: str | Path) -> None:
    """Load one JSON table file (e.g. one a tuning run just wrote) into the lookup."""
    register_table(json.loads(Path(path).read_text()))


def _ensure_loaded() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for p in sorted(_TABLE_DIR.glob("configs_*.json")):
        load_table(p)


def heuristic_config(kind: str, n: int, k: int, m: int, capability: tuple[int, int]) -> GemmConfig:
    """Defaults for untuned shapes/GPUs (where they come from: docs/design/checkpoint-layout.md).

    Small M (H200 winners): the small-M kernel, K split 4 ways in-program, one 16-row MMA
    tile per warp and slice (swap_ab; more warps than that would repeat each other's
    dequantization); FP8 weights of WIDE_N_MIN+ rows the tiled kernel instead. Mid M: 64-wide
    swapped tiles. Large M: 128..256 x 128 tiles (wgmma).
    Pre-Ampere parts (64 KB of shared memory) get at most 2 stages and 128-wide K tiles.
    """
    old = capability not in SM80_PLUS
    if m <= SMALL_M_MAX:
        wide = n >= WIDE_N_MIN
        if kind == "fp8" and wide:  # the tiled kernel beat the split ones here (H200)
            cfg = GemmConfig(16, 64, 256, 4, 4)
        else:  # K split 4 ways in-program; one 16-row MMA tile per warp and slice
            cfg = GemmConfig(16, 32 if wide else 16, 128, 8 if wide else 4, 3, swap_ab=1, split=4)
    elif m <= 64:
        cfg = GemmConfig(max(16, 1 << (m - 1).bit_length()), 64, 256, 4, 3, swap_ab=1)
    elif m <= 256:
        cfg = GemmConfig(64, 128, 64, 4, 3)
    else:
        cfg = GemmConfig(256 if capability in SM90_PLUS else 128, 128, 64, 8, 3)
    if kind == "fp8" and m > SMALL_M_MAX:
        cfg = replace(cfg, block_k=min(cfg.block_k, 128))
    if old:
        cfg = replace(cfg, num_stages=min(cfg.num_stages, 2), block_k=min(cfg.block_k, 128))
    return cfg


def _nearest_bucket(buckets: dict, m: int) -> dict | None:
    """Closest tuned bucket on the same side of the small/large split (log distance)."""
    small = m <= SMALL_M_MAX
    keys = [int(b) for b in buckets if (int(b) <= SMALL_M_MAX) == small]
    if not keys:
        return None
    want = math.log2(max(m, 1))
    best = min(keys, key=lambda b: (abs(math.log2(b) - want), b))
    return buckets[str(best)]


def get_config(kind: str, facts: DeviceFacts, n: int, k: int, m: int) -> tuple[GemmConfig, str]:
    """Config for one call on the device of ``facts`` plus its source ('table:<gpu>' or
    'heuristic'); host-only, no sync."""
    _ensure_loaded()
    name, cap = facts.name, facts.capability or (0, 0)
    shape = f"{n}x{k}"
    gpu_table = _TABLES.get(name, {})
    for kind_key in (kind, "nvfp4"):
        buckets = gpu_table.get(kind_key, {}).get(shape)
        if buckets:
            hit = buckets.get(str(m_bucket(m))) or _nearest_bucket(buckets, m)
            if hit:
                return GemmConfig.from_dict(hit), f"table:{name}:{kind_key}"
    return heuristic_config(kind, n, k, m, cap), "heuristic"


def _cfgs(bm: int, rows: list[tuple[int, ...]]) -> list[GemmConfig]:
    """rows: (block_n, block_k, num_warps, num_stages, swap_ab, split)."""
    return [GemmConfig(bm, bn, bk, w, st, swap_ab=sw, split=sp) for bn, bk, w, st, sw, sp in rows]


def candidate_configs(m: int, kind: str = "nvfp4") -> list[GemmConfig]:
    """The sweep used by :func:`tune` for one M: tile families per regime.

    Warps are kept at or under what the MMA tiles can keep apart (block_n/8 per K slice, or
    block_n/16 with swap_ab), so that no warp repeats another's dequantization. The FP8
    kernels share the families (``block_k`` counts elements: one byte each for FP8).
    """
    if m <= SMALL_M_MAX:
        cands = _cfgs(
            16,
            [
                (16, 128, 4, 3, 1, 4),
                (32, 128, 8, 3, 1, 4),
                (32, 256, 8, 2, 1, 4),
                (64, 128, 8, 3, 1, 2),
                (32, 128, 16, 2, 1, 8),
                (16, 128, 8, 2, 1, 8),
                (64, 128, 16, 2, 1, 4),
                (16, 256, 4, 2, 1, 4),
                (32, 128, 8, 3, 0, 2),
                (64, 256, 4, 4, 0, 0),
                (32, 512, 2, 3, 0, 0),
                (64, 256, 4, 3, 1, 0),
            ],
        )
    elif m <= 64:
        bm = max(16, 1 << (m - 1).bit_length())
        cands = _cfgs(
            bm,
            [
                (16, 128, 4, 3, 1, 4),
                (32, 128, 8, 3, 1, 4),
                (32, 256, 8, 2, 1, 4),
                (64, 256, 4, 3, 1, 0),
                (128, 128, 4, 3, 1, 0),
                (64, 128, 4, 4, 0, 0),
                (128, 128, 4, 3, 0, 0),
            ],
        )
    else:
        cands = [
            GemmConfig(bm, bn, bk, w, st, swap_ab=sw, split=sp)
            for (bm, bn, bk, w, st, sw, sp) in [
                (64, 128, 64, 4, 3, 0, 0),
                (64, 128, 128, 4, 3, 0, 0),
                (128, 128, 64, 8, 3, 0, 0),
                (128, 128, 64, 4, 4, 0, 0),
                (128, 256, 64, 8, 3, 0, 0),
                (256, 128, 64, 8, 3, 0, 0),
                (256, 128, 64, 8, 4, 0, 0),
            ]
        ]
        if m <= 256:  # few output tiles on 4096-wide layers: in-program K split variants
            cands += _cfgs(64, [(32, 128, 8, 3, 1, 4), (64, 128, 8, 3, 1, 2)])
            cands += _cfgs(128, [(32, 128, 8, 2, 1, 2)])
    return cands


def tune(
    run: Callable[[GemmConfig], Callable[[], object]],
    timer: Callable[[Callable[[], object]], float],
    candidates: Iterable[GemmConfig],
    check: Callable[[object], bool] | None = None,
) -> tuple[GemmConfig | None, list[tuple[GemmConfig, float | str]]]:
    """Offline tuning: time each candidate, keep the fastest one that passes ``check``.

    ``run(cfg)`` returns a zero-argument callable launching the kernel with ``cfg``;
    ``timer(fn)`` returns its time. Candidates that fail to compile (shared memory, registers)
    or fail ``check`` are recorded with the reason and skipped. Never called at run time.
    """
    results: list[tuple[GemmConfig, float | str]] = []
    best: tuple[float, GemmConfig] | None = None
    for cfg in candidates:
        try:
            fn = run(cfg)
            out = fn()
            if check is not None and not check(out):
                results.append((cfg, "wrong result"))
                continue
            t = timer(fn)
        except Exception as exc:  # a config the compiler rejects is data, not a failure
            results.append((cfg, f"{type(exc).__name__}: {str(exc)[:120]}"))
            continue
        results.append((cfg, t))
        if best is None or t < best[0]:
            best = (t, cfg)
    return (best[1] if best else None), results


def table_from_results(gpu: str, entries: Sequence[tuple[str, int, int, int, GemmConfig]]) -> dict:
    """Build a table dict from (kind, n, k, m, cfg) winners, in the JSON layout above."""
    out: dict = {"version": 1, "gpus": {gpu: {}}}
    for kind, n, k, m, cfg in entries:
        out["gpus"][gpu].setdefault(kind, {}).setdefault(f"{n}x{k}", {})[str(m_bucket(m))] = (
            cfg.to_dict()
        )
    return out


# --------------------------------------------------------------------------------------------
# warps of the mma.sync kernels (both layouts)

MAX_TOKENS_PER_PROGRAM = 64  # 8 MMA column tiles of 8 tokens


def mma_base_config(tiles: int, chunks: int, m: int) -> tuple[int, int, int, int, int]:
    """(NT, WT, WK, UNROLL, R) with one step of weight loads in flight (also the
    checkpoint-layout kernel's linear configs, benchmarks/probes/ckpt_mma_linear.py): token
    tiles per program from M; warps side by side (activation reuse through L1); K split; chunks
    in flight per warp; tiles per warp (activation reuse in registers; it pays only with 64+
    tokens per program). From the H200 sweeps (benchmarks/results/mma-sweep-h200-*.log,
    docs/design/mma-layout.md)."""
    nt = 1
    while nt * 8 < min(m, MAX_TOKENS_PER_PROGRAM):
        nt *= 2
    big = tiles >= 1024  # e.g. a fused 28672-row gate_up: enough programs without a K split
    r = 1
    if nt == 1:  # wide weights (fused gate_up) at M <= 8: 2x2x2 beat 1x4x2
        wt, wk, unroll = (2, 2, 2) if big else ((1, 8, 4) if chunks >= 128 else (1, 8, 2))
    elif nt == 2:  # two builds of the sweep agree
        if big:  # gate_up M=16: 2x2x2x2 beat 8x2x1
            wt, wk, unroll, r = 2, 2, 2, 2
        else:  # qkv M=16: 1x4x2 beat 1x8x2; o (fewer tiles) keeps 1x8x2
            wt, wk, unroll = (1, 4, 2) if tiles >= 384 else (1, 8, 2)
    elif nt == 4:
        wt, wk, unroll = (8, 1, 2) if big else (1, 4, 2)
    elif big:
        wt, wk, unroll, r = (8, 1, 1, 2) if m <= 64 else (4, 1, 1, 4)
    elif m > 64 and chunks >= 128:  # a long-K weight (down) at two token blocks
        wt, wk, unroll, r = 1, 4, 2, 2
    else:
        wt, wk, unroll = (4, 2, 2) if tiles >= 384 else (2, 4, 2)
    return (nt, *fit_mma_config(tiles, chunks, wt, wk, r, unroll))


def fit_mma_config(
    tiles: int, chunks: int, wt: int, wk: int, r: int, unroll: int
) -> tuple[int, ...]:
    """(WT, WK, UNROLL, R) shrunk to the weight: a K split no larger than the chunks (a power of
    two, Triton's num_warps) and WT * R dividing the row tiles (the grid is whole)."""
    while wk > 1 and wk > chunks:
        wk //= 2
    while r > 1 and tiles % r:
        r //= 2
    while wt > 1 and tiles % (wt * r):
        wt //= 2
    return wt, wk, unroll, r
