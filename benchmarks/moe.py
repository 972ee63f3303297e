#!/usr/bin/env python3
"""Side-by-side timing of one MoE layer per model on one GPU, in one run.

Models (experts, top-k, hidden, intermediate): Qwen3-30B-A3B (128, 8, 2048, 768), Mixtral-8x7B
(8, 2, 4096, 14336), DeepSeek-V3 (256, 8, 7168, 2048); M = 1 ... 4096 tokens. Columns:

* ``nvfp4``: what QuantMoE's triton backend runs on NVFP4 experts, the whole op (align +
  gate/up GEMM with fused SiLU + down GEMM + top-k reduction), on the experts repacked once into
  the mma16x64 layout (kernels/mma_layout/, same bytes): the mma.sync kernels with few tokens
  per expert, the grouped tl.dot GEMM in between, dequantize + grouped GEMM with very many (the
  ``config`` column says which);
* ``nvfp4 ckpt``: the kernels on the checkpoint layout (kernels/checkpoint_layout/moe.py with its
  own heuristic: what ran before the repack, and what non-repackable layers still run);
* ``bf16``: the same experts dequantized to bf16, run with ``torch._grouped_mm`` on tokens
  sorted by expert (sort, gather, two grouped GEMMs, SiLU, weighted sum), i.e. what a user
  gets from an unquantized MoE; a per-expert loop (eager timing, it synchronizes) where this
  torch has no ``_grouped_mm``. All experts are held in bf16 (they fit in an H200);
* ``marlin``: vLLM's fused Marlin MoE GEMMs on the same experts through our marlin backend
  (benchmarks/peers.py; ``--marlin-lib DIR``, by default at the ``--quick`` M values:
  ``--marlin-ms``), "not available: <reason>" where no provider loads;
* ``floor``: NVFP4 bytes of the experts the routing actually touches (distinct ids, averaged
  over the rotated routings) + activations in/out, divided by the copy bandwidth measured here.

``--format mxfp4`` times MXFP4 experts instead (E8M0 scales, group 32), on gpt-oss-20b / 120b
(32 / 128 experts, top-4, H = I = 2880) with gpt-oss's clamped SwiGLU and float32 expert
biases, the bf16 baseline running the same activation and biases: the ``mxfp4`` column is the
repacked stacks (one global scale per expert), ``mxfp4 ckpt`` the tl.dot kernels on the
checkpoint layout.

Routing: random router logits, top-k, softmax over the selected (renormalized), 8 different
routings (and activations) cycled inside each CUDA graph so that consecutive calls touch
different experts (the weights of one call stay out of L2 for the next). Each kernel is checked
against the reference backend (fp32, chunked dequant) before it is timed; a failed check is
recorded and not timed. Timing: median over CUDA-graph replays after a warm-up.

    PYTHONPATH=$PWD python3 benchmarks/moe.py [--quick] [--out DIR] [--models a,b] [--sweep]
                                              [--format mxfp4]

``--sweep`` then times alternative tile configs at a few points (written to a second JSON)
within ``--sweep-budget`` seconds. ``--smoke`` runs tiny shapes on the CPU interpreter (a
check of this script, no meaningful timing).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import argparse
import datetime as dt
import json
import math
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import peers  # benchmarks/peers.py: the Marlin column
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantdispatch.api import current_settings
from quantdispatch.backends.base import CheckpointMeta, Layout, MoeCall
from quantdispatch.backends.reference import ReferenceBackend
from quantdispatch.kernels.checkpoint_layout import moe_plan as ckpt_plan
from quantdispatch.kernels.checkpoint_layout.moe import fused_moe
from quantdispatch.kernels.common.device_facts import device_facts
from quantdispatch.kernels.common.moe_plan import DequantMoeConfig, MmaGemmConfig, MmaMoeConfig
from quantdispatch.kernels.mma_layout.moe_gemm import mma_layout_moe
from quantdispatch.kernels.mma_layout.moe_plan import (
    MoeGemmTile,
    SmallMoeConfig,
    mma_layout_moe_plan,
)
from quantdispatch.kernels.mma_layout.moe_stacks import repack_experts, repack_experts_mx
from quantdispatch.kernels.regimes import MMA_LAYOUT_MOE, Family
from quantdispatch.moe.activations import apply_activation

#: QUANTDISPATCH_PDL as the layers would pass it (kernels read no environment).
PDL = current_settings().pdl

MODELS: dict[str, tuple[int, int, int, int]] = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "deepseek-v3": (256, 8, 7168, 2048),
}
MX_MODELS: dict[str, tuple[int, int, int, int]] = {
    "gpt-oss-20b": (32, 4, 2880, 2880),
    "gpt-oss-120b": (128, 4, 2880, 2880),
}
SMOKE_MODELS = {"tiny": (8, 2, 128, 64), "tiny-wide": (16, 4, 192, 128)}
#: per format: the activation (and its parameters) and whether the experts carry biases
FORMAT_ACT = {"nvfp4": ("silu", (), False), "mxfp4": ("swiglu_oai", (1.702, 7.0), True)}
MS = [1, 4, 16, 64, 256, 1024, 4096]
QUICK_MS = [1, 16, 256, 4096]
SMOKE_MS = [1, 4, 33]
ROUTINGS = 8
BOUND = 2e-2  # bf16 normwise vs the fp32 reference (tests/gpu/test_moe_gpu.py: 1.5e-2 vs f64)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def log(*a: object) -> None:
    print(*a, flush=True)


# ---- timing ----------------------------------------------------------------------------------


def time_graph(calls: list[Callable[[], object]], target_s: float = 0.25) -> float:
    """Median microseconds per call over CUDA-graph replays of all ``calls`` back to back."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in calls:  # warm-up: compiles, allocator pools
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    replays = max(5, min(50, int(target_s / max(one, 1e-6))))
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    del g
    return statistics.median(times)


def time_eager(calls: list[Callable[[], object]], reps: int = 5) -> float:
    """Median microseconds per call, eager (for paths that synchronize, and the CPU smoke)."""
    for f in calls:
        f()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for f in calls:
            f()
        sync()
        times.append((time.perf_counter() - t0) * 1e6 / len(calls))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Streaming bandwidth, bytes read + written per second (the floor's denominator): the
    faster of a device copy and an SM elementwise pass, measured exactly as linear.py does so
    that both benchmarks' floors use one number (an in-graph copy alone reads ~2.8 TB/s on the
    H200, the SM pass ~4.2)."""
    from linear import copy_bandwidth as streaming_bandwidths

    return max(streaming_bandwidths().values())


def rebuild(path: Path, bandwidth_tbps: float, source: str) -> None:
    """Rescale a result file's floors to another measured bandwidth and rewrite json + md."""
    data = json.loads(path.read_text())
    meta, rows = data["meta"], data["rows"]
    old = meta["copy_bw_TBps"]
    for r in rows:
        if r.get("floor_us") is not None:
            r["floor_us"] = r["floor_us"] * old / bandwidth_tbps
    meta.setdefault("measured_copy_bw_TBps", old)
    meta["copy_bw_TBps"] = bandwidth_tbps
    meta["floor_bandwidth_source"] = source
    path.write_text(json.dumps(data, indent=1))
    path.with_suffix(".md").write_text(markdown(meta, rows))


def driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=False,
        ).stdout  # fmt: skip
        return out.strip().splitlines()[0]
    except Exception:
        return "unknown"


# ---- one model's layer ---------------------------------------------------------------------


class Layer:
    """Random NVFP4 or MXFP4 experts of one model (stacked canonical tensors), the same experts
    repacked, and their bf16 copy."""

    def __init__(self, e: int, top_k: int, h: int, i: int, dev: torch.device, seed: int,
                 fmt: str = "nvfp4"):  # fmt: skip
        self.e, self.top_k, self.h, self.i, self.dev, self.fmt = e, top_k, h, i, dev, fmt
        self.act, self.params, biased = FORMAT_ACT[fmt]
        gen = torch.Generator(device=dev).manual_seed(seed)
        make = self._nvfp4 if fmt == "nvfp4" else self._mxfp4
        self.w13 = make(2 * i, h, gen)
        self.w2 = make(h, i, gen)
        # the same experts in the mma16x64 layout (what QuantMoE holds on an SM 8.0+ GPU)
        if fmt == "nvfp4":
            self.r13 = [*repack_experts(self.w13[0], self.w13[1], torch.bfloat16), self.w13[2]]
            self.r2 = [*repack_experts(self.w2[0], self.w2[1], torch.bfloat16), self.w2[2]]
        else:
            self.r13 = list(repack_experts_mx(self.w13[0], self.w13[1], torch.bfloat16))
            self.r2 = list(repack_experts_mx(self.w2[0], self.w2[1], torch.bfloat16))
        self.b13 = self.b2 = None
        if biased:  # gpt-oss: float32 biases per expert on both GEMMs
            self.b13 = 0.05 * torch.randn(e, 2 * i, generator=gen, device=dev)
            self.b2 = 0.05 * torch.randn(e, h, generator=gen, device=dev)
        per_weight = 0.5 + (1 / 16 if fmt == "nvfp4" else 1 / 32)
        extra = 4 * (2 * i + h) if biased else 8
        self.bytes_per_expert = int(3 * i * h * per_weight + extra)
        # bf16 experts [E, N, K], dequantized once (the unquantized baseline's weights)
        self.d13 = self._dequant(self.w13)
        self.d2 = self._dequant(self.w2)
        self.grouped = hasattr(torch, "_grouped_mm") and dev.type == "cuda"

    def _nvfp4(self, n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
        e, dev = self.e, self.dev
        packed = torch.randint(0, 256, (e, n, k // 2), generator=gen, device=dev, dtype=torch.uint8)
        bits = torch.randint(0x28, 0x48, (e, n, k // 16), generator=gen, device=dev,
                             dtype=torch.uint8)  # fmt: skip
        gs = (0.5 + torch.rand(e, generator=gen, device=dev)) / (3 * math.sqrt(k))
        return [packed, bits.view(torch.float8_e4m3fn), gs.to(torch.float32)]

    def _mxfp4(self, n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
        """E8M0 exponents around 2^-7 (|w| ~ 1/sqrt(K)), spanning 8 binades (within the
        layout's 18: every expert is repacked, as a real checkpoint's normally are)."""
        e, dev = self.e, self.dev
        packed = torch.randint(0, 256, (e, n, k // 2), generator=gen, device=dev, dtype=torch.uint8)
        e8m0 = torch.randint(116, 124, (e, n, k // 32), generator=gen, device=dev,
                             dtype=torch.uint8)  # fmt: skip
        return [packed, e8m0]

    def _dequant(self, w: list[torch.Tensor]) -> torch.Tensor:
        packed, bs = w[0], w[1]
        e, n, kh = packed.shape
        group = 16 if self.fmt == "nvfp4" else 32
        lut = torch.tensor(E2M1 + [-v for v in E2M1], device=self.dev)
        out = torch.empty((e, n, 2 * kh), dtype=torch.bfloat16, device=self.dev)
        for x in range(e):
            codes = torch.stack([packed[x] & 0xF, packed[x] >> 4], -1).flatten(-2).long()
            if self.fmt == "nvfp4":
                scale = bs[x].float() * w[2][x]
            else:
                scale = torch.exp2(bs[x].float() - 127)
            v = lut[codes].view(n, -1, group) * scale[:, :, None]
            out[x] = v.view(n, -1).to(torch.bfloat16)
        return out

    def routings(self, m: int, count: int, gen: torch.Generator):
        """``count`` different (x, ids, weights) inputs: softmax over the top-k logits."""
        out = []
        for _ in range(count):
            logits = torch.randn(m, self.e, generator=gen, device=self.dev)
            val, ids = logits.topk(self.top_k, dim=-1)
            w = torch.softmax(val, dim=-1)
            x = torch.randn(m, self.h, generator=gen, device=self.dev).to(torch.bfloat16)
            out.append((x, ids.to(torch.int32), w.float()))
        return out

    def config(self, m: int):
        """The repacked path's regime; the CPU interpreter runs no PTX: the GEMM there."""
        facts = device_facts(self.dev)
        cfg = mma_layout_moe_plan(m, self.top_k, self.e, self.i, self.h, facts, pdl=PDL)
        return cfg if self.dev.type == "cuda" or isinstance(cfg, MoeGemmTile) else MoeGemmTile(16)

    def nvfp4(self, x, ids, w, config=None):
        """The repacked stacks (named for the default format; MXFP4 runs here too)."""
        return mma_layout_moe(x, ids, w, self.r13, self.r2, self.b13, self.b2,
                              activation=self.act, params=list(self.params),
                              packed_for=torch.bfloat16, pdl=PDL,
                              config=config or self.config(x.shape[0]))  # fmt: skip

    def nvfp4_ckpt(self, x, ids, w, config=None):
        return fused_moe(x, ids, w, self.w13, self.w2, self.b13, self.b2, fmt=self.fmt,
                            activation=self.act, params=list(self.params),
                            config=config)  # fmt: skip

    def reference(self, x, ids, w):
        w13, w2, params = tuple(self.w13), tuple(self.w2), tuple(self.params)
        call = MoeCall(x, ids, w, w13, w2, self.b13, self.b2, self.fmt, self.act, params,
                       Layout.CHECKPOINT, CheckpointMeta())  # fmt: skip
        return ReferenceBackend().moe(call)

    def bf16(self, x, ids, w):
        """Unquantized MoE: sort pairs by expert, two grouped GEMMs (+ the experts' biases),
        the activation, weighted top-k sum."""
        m, k = ids.shape
        flat = ids.flatten().long()
        order = torch.argsort(flat, stable=True)
        xs = x.index_select(0, order // k)
        row_expert = flat[order]

        def act(hh: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
            if self.b13 is not None:
                hh = hh + self.b13[row_expert[rows]].to(hh.dtype)
            if self.act == "silu":
                return F.silu(hh[:, : self.i]) * hh[:, self.i :]
            return apply_activation(hh, self.act, self.params)

        def down_bias(ys: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
            return ys if self.b2 is None else ys + self.b2[row_expert[rows]].to(ys.dtype)

        if self.grouped:
            counts = torch.zeros(self.e, dtype=torch.int32, device=x.device)
            counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            hh = torch._grouped_mm(xs, self.d13.transpose(1, 2), offs=offs)
            a = act(hh, slice(None))
            ys = down_bias(torch._grouped_mm(a, self.d2.transpose(1, 2), offs=offs), slice(None))
        else:  # eager per-expert loop (host sync on the counts)
            counts = torch.bincount(flat, minlength=self.e).tolist()
            ys = torch.empty((m * k, self.h), dtype=x.dtype, device=x.device)
            start = 0
            for e, c in enumerate(counts):
                if c:
                    rows = slice(start, start + c)
                    a = act(xs[rows] @ self.d13[e].T, rows)
                    ys[rows] = down_bias(a @ self.d2[e].T, rows)
                start += c
        y = torch.empty_like(ys)
        y[order] = ys
        return (y.view(m, k, self.h).float() * w[:, :, None]).sum(1).to(x.dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(torch.isfinite(out).all()):
        return math.inf
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def distinct_experts(ids: torch.Tensor) -> int:
    return int(torch.unique(ids).numel())


# ---- main ------------------------------------------------------------------------------------


def config_dict(
    cfg: ckpt_plan.MoeConfig | MmaMoeConfig | DequantMoeConfig | MoeGemmTile,
) -> dict:
    family: Family = cfg.family  # the regime table's name for it
    if isinstance(cfg, SmallMoeConfig):
        return {"kernel": "topk-sum", "family": family.value, **vars(cfg)}
    if isinstance(cfg, DequantMoeConfig):
        return {"kernel": "dequant+grouped_mm", "family": family.value}
    if isinstance(cfg, MoeGemmTile):
        return {"kernel": "gemm", "family": family.value, **vars(cfg)}
    return {
        "kernel": "mma" if isinstance(cfg, MmaMoeConfig) else "tl.dot",
        "family": family.value,
        "block_m": cfg.block_m,
        "direct": cfg.direct,
        "gemm1": vars(cfg.gemm1).copy(),
        "gemm2": vars(cfg.gemm2).copy(),
    }


def config_label(c: dict) -> str:
    direct = " direct" if c.get("direct") else ""
    g1, g2 = c.get("gemm1", {}), c.get("gemm2", {})
    if c.get("kernel") == "dequant+grouped_mm":
        return "dequant + grouped_mm"
    if c.get("kernel") in ("topk-sum", "fused") and "warps_down" in c:  # "fused": early JSONs
        fields = {k: v for k, v in c.items() if k not in ("kernel", "family")}
        return SmallMoeConfig(**fields).label()
    if c.get("kernel") == "fused":  # session 6's removed grid-barrier kernel (its sweep JSONs)
        return f"grid barrier w{c.get('warps')}u{c.get('unroll')} x{c.get('programs_per_sm')}/SM"
    if c.get("kernel") == "gemm":
        tile = {k: v for k, v in c.items() if k not in ("kernel", "family")}
        return MoeGemmTile(**tile).label()
    if c.get("kernel") == "mma":
        return (
            f"mma BM{c.get('block_m')}{direct} wk{g1.get('wk')}x{g1.get('unroll')}/"
            f"{g2.get('wk')}x{g2.get('unroll')}"
        )
    return f"BM{c.get('block_m')}{direct} n{g1.get('block_n')}/{g2.get('block_n')}"


def run_point(layer: Layer, name: str, m: int, gen, bw: float, graphs: bool,
              marlin: Callable | None = None) -> list[dict]:  # fmt: skip
    inputs = layer.routings(m, ROUTINGS if graphs else 2, gen)
    touched = statistics.mean(distinct_experts(ids) for _, ids, _ in inputs)
    moved = touched * layer.bytes_per_expert + 2 * m * layer.h * 2
    floor = moved / bw * 1e6 if bw else math.nan
    x0, ids0, w0 = inputs[0]
    ref = layer.reference(x0, ids0, w0)
    cfg = layer.config(m)
    rows = []
    fmt = layer.fmt
    facts = device_facts(x0.device)
    ckpt_cfg = ckpt_plan.checkpoint_layout_moe_plan(
        m, layer.top_k, layer.e, layer.i, layer.h, fmt, facts
    )
    fns = {fmt: layer.nvfp4, f"{fmt}_ckpt": layer.nvfp4_ckpt, "bf16": layer.bf16}
    if marlin is not None:
        fns[peers.MOE_KERNEL] = marlin
    for kern, fn in fns.items():
        row = {"model": name, "M": m, "kernel": kern, "us": None, "rel_err": math.nan,
               "floor_us": floor, "experts_touched": touched}  # fmt: skip
        if kern.startswith(fmt):
            row["config"] = config_dict(cfg if kern == fmt else ckpt_cfg)
        elif kern == peers.MOE_KERNEL:
            row["path"] = "MarlinBackend.moe"
        else:
            row["path"] = "grouped_mm" if layer.grouped else "per-expert loop (eager)"
        try:
            err = rel_err(fn(x0, ids0, w0), ref)
            row["rel_err"] = err
            if err < BOUND:
                calls = [lambda a=a, b=b, c=c, fn=fn: fn(a, b, c) for a, b, c in inputs]
                use_graph = graphs and (kern != "bf16" or layer.grouped)
                row["us"] = (
                    time_graph(calls) if use_graph else time_eager(calls, 5 if graphs else 1)
                )
                row["timing"] = "cuda-graph" if use_graph else "eager"
            else:
                log(f"  {name} M={m} {kern}: CHECK FAILED rel_err={err:.3g}")
        except Exception as exc:  # keep the other column
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(f"  {name} M={m} {kern}: {row['error']}")
        rows.append(row)
    nv, bf = rows[0], rows[2]
    ratio = f"{bf['us'] / nv['us']:.2f}x" if nv["us"] and bf["us"] else "-"
    vs_floor = f"{nv['us'] / floor:.2f}x" if nv["us"] and floor == floor else "-"
    dot = f" (ckpt {fmt_us(rows[1]['us'])})"
    log(
        f"{name} M={m}: {fmt} {fmt_us(nv['us'])}{dot} (e={nv['rel_err']:.1e}) "
        f"bf16 {fmt_us(bf['us'])} (e={bf['rel_err']:.1e}) floor {floor:.1f} | "
        f"bf16/{fmt} {ratio} {fmt}/floor {vs_floor}"
        + (f" | marlin {fmt_us(rows[3]['us'])} (e={rows[3]['rel_err']:.1e})" if marlin else "")
    )
    return rows


def fmt_us(us: float | None) -> str:
    return "FAIL" if us is None else f"{us:.1f}"


def markdown(meta: dict, rows: list[dict]) -> str:
    by = {(r["model"], r["M"], r["kernel"]): r for r in rows}
    fmt = meta.get("format", "nvfp4")
    fp4 = fmt.upper()
    act = ("gpt-oss's clamped SwiGLU (alpha 1.702, limit 7) and float32 expert biases on both "
           "GEMMs, in every column. " if fmt == "mxfp4" else "")  # fmt: skip
    out = [
        f"# MoE layer on {meta['device']} ({meta['date']})",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}"
        + (" (register-operand wgmma settled each K step)" if meta.get("rs_wgmma_settled") else "")
        + f", driver {meta['driver']}, CUDA "
        f"{meta['cuda']}; streaming bandwidth {meta['copy_bw_TBps']:.2f} TB/s (read+write; "
        f"{meta.get('floor_bandwidth_source', 'the faster of a copy and an SM pass')}). Median "
        f"us per call over CUDA-graph replays, {ROUTINGS} routings cycled per graph; each kernel "
        f"checked against the reference backend first (FAIL = not timed). bf16 activations. {act}"
        f"floor = {fp4} bytes of the experts touched + x + out, / that bandwidth. bf16 = "
        f"{meta['bf16_path']}. Targets: M <= 16: bf16/{fmt} >= 2 and {fmt}/floor <= 2; "
        f"M = 4096: {fmt}/bf16 <= 1.5.",
        "",
        *([peers.moe_note(meta, fmt), ""] if "marlin" in meta else []),
        f"| model | E, top-k, H, I | M | experts touched | {fmt} | {fmt} ckpt | bf16 | floor "
        f"| bf16/{fmt} | {fmt}/floor | err {fmt} | config |" + peers.moe_head(meta, fmt)[0],
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + peers.moe_head(meta, fmt)[1],
    ]
    for name, dims in meta["models"].items():
        for m in meta["ms"]:
            nv, bf = by.get((name, m, fmt)), by.get((name, m, "bf16"))
            if nv is None or bf is None:
                continue
            ok = nv["us"] and bf["us"]
            r1 = f"{bf['us'] / nv['us']:.2f}x" if ok else "-"
            fl = nv["floor_us"]
            r2 = f"{nv['us'] / fl:.2f}x" if nv["us"] and fl == fl else "-"
            dot = by.get((name, m, f"{fmt}_ckpt"))
            out.append(
                f"| {name} | {', '.join(map(str, dims))} | {m} | {nv['experts_touched']:.1f} | "
                f"{fmt_us(nv['us'])} | {fmt_us(dot['us']) if dot else '-'} | {fmt_us(bf['us'])} "
                f"| {fl:.1f} | {r1} | {r2} | {nv['rel_err']:.1e} | "
                f"{config_label(nv.get('config') or {})} |"
                + peers.moe_cells(meta, by, name, m, fmt)
            )
    return "\n".join(out) + "\n"


# around the regime thresholds of kernels/mma_layout/moe_plan.py (tokens per expert in brackets)
SWEEP_POINTS = [("qwen3-30b-a3b", 16), ("qwen3-30b-a3b", 64), ("qwen3-30b-a3b", 128),  # 1, 4, 8
                ("qwen3-30b-a3b", 256), ("qwen3-30b-a3b", 1024),  # 16, 64
                ("mixtral-8x7b", 16), ("mixtral-8x7b", 32), ("mixtral-8x7b", 256),  # 4, 8, 64
                ("mixtral-8x7b", 1024),  # 256
                ("deepseek-v3", 128), ("deepseek-v3", 256),  # 4, 8
                ("deepseek-v3", 1024)]  # 32  # fmt: skip


WARP_SWEEP = [((1, 2, 2), (1, 1, 2)), ((1, 4, 2), (1, 2, 2)), ((1, 2, 2), (1, 2, 2)),
              ((1, 1, 2), (1, 1, 2)), ((1, 4, 1), (1, 1, 1)), ((2, 2, 2), (2, 1, 2)),
              ((1, 2, 1), (1, 1, 1))]  # fmt: skip


def sweep_configs(m: int, top_k: int, e: int, i: int, h: int, only_small: bool = False) -> list:
    """The mma.sync kernels (the heuristic's warps; 8- and 16-pair blocks) up to 16 tokens per
    expert, the 8-pair blocks' warps per GEMM (WARP_SWEEP) where the heuristic runs them,
    grouped GEMM tiles from 2 on, dequantize + grouped_mm from 256; the single-pair kernels also
    where the heuristic picks 8-pair blocks at <= 1 token per expert. ``only_small``: the
    single-pair kernels (and the pick) only."""
    from quantdispatch.kernels.common.moe_plan import mma_moe_config

    tpe = m * top_k / e
    out: list = []
    if 4 * m * top_k <= e:  # single pairs: the top-k sum inside the down kernel
        pick = mma_layout_moe_plan(m, top_k, e, i, h, device_facts(torch.device("cuda")), pdl=PDL)
        out.append(pick)
        out.append(replace(pick, pdl=False, prefetch=0))
        if pick.pdl:  # the down launch dependent on gate/up: L2 prefetch of 0 .. all chunks
            ch = i // 64
            out += [replace(pick, prefetch=pf) for pf in (0, ch // 8, ch // 4, ch // 2, ch)]
            out += [replace(pick, prefetch=0, warps_down=w, unroll_down=u)
                    for w in (8, 16) for u in (2, 4)]  # fmt: skip
        for w in (2, 4, 8, 16):  # gate/up warps and chunks in flight, the picked down
            out += [replace(pick, warps=w, unroll=u) for u in (1, 2, 4)]
        for w in (4, 8, 16):  # down, the picked gate/up
            out += [replace(pick, warps_down=w, unroll_down=u) for u in (1, 2, 4)]
        out = list(dict.fromkeys(out))
        if only_small:
            return out
    if tpe <= 1 and not out:  # 8-pair blocks picked: the single-pair kernels as challengers
        from quantdispatch.kernels.mma_layout.moe_plan import small_moe_config

        tuned = mma_moe_config(m * top_k, e, i, h, direct=True, repacked=True).gemm1
        pick = small_moe_config(m, top_k, i, h, tuned.wk, tuned.unroll, pdl=True)
        out += [pick, replace(pick, warps=4, unroll=2), replace(pick, warps=8, unroll=2),
                replace(pick, warps_down=8), replace(pick, warps_down=16)]  # fmt: skip
        out = list(dict.fromkeys(out))
        if only_small:  # against the heuristic's pick only (sweep() times it first)
            return out
    if tpe <= 1:  # single pairs or 8-pair blocks, warps per GEMM (wt, wk, unroll) around the pick
        for direct in (True, False):
            for g1, g2 in WARP_SWEEP:
                out.append(MmaMoeConfig(1, MmaGemmConfig(*g1), MmaGemmConfig(*g2), direct))
        return out
    if tpe <= 16:
        out += [mma_moe_config(m * top_k, e, i, h, direct=False, nt=nt) for nt in (1, 2)]
    if tpe <= MMA_LAYOUT_MOE.mma.max_tokens_per_expert:  # 8-pair blocks picked: their warps too
        out += [MmaMoeConfig(1, MmaGemmConfig(*g1), MmaGemmConfig(*g2)) for g1, g2 in WARP_SWEEP]
    if tpe >= 2:
        blocks = [bm for bm in (16, 32, 64, 128) if bm <= max(16, 4 * tpe)]
        for bm in blocks[-3:]:
            out += [MoeGemmTile(bm, 64, 2, 4, 4), MoeGemmTile(bm, 64, 2, 4, 3),
                    MoeGemmTile(bm, 128, 2, 8, 3)]  # fmt: skip
    if tpe >= 256:  # dequantize + grouped_mm as a challenger below the plan's threshold too
        out.append(DequantMoeConfig())
    return out


def sweep(layers: dict[str, Layer], gen, budget_s: float, only_small: bool = False) -> list[dict]:
    t0 = time.time()
    rows = []
    for name, m in SWEEP_POINTS:
        layer = layers.get(name)
        if layer is None:
            continue
        inputs = layer.routings(m, ROUTINGS, gen)
        ref = layer.reference(*inputs[0])
        pick = layer.config(m)  # timed first and marked, whatever the sweep holds
        others = sweep_configs(m, layer.top_k, layer.e, layer.i, layer.h, only_small)
        for cfg in dict.fromkeys([pick, *others]):
            if time.time() - t0 > budget_s:
                log("sweep: budget spent")
                return rows
            row = {"model": name, "M": m, "config": config_dict(cfg), "us": None,
                   "pick": cfg == pick}  # fmt: skip
            try:
                err = rel_err(layer.nvfp4(*inputs[0], config=cfg), ref)
                row["rel_err"] = err
                if err < BOUND:
                    run = layer.nvfp4
                    calls = [
                        lambda a=a, b=b, c=c, cfg=cfg, run=run: run(a, b, c, cfg)
                        for a, b, c in inputs
                    ]
                    row["us"] = time_graph(calls, target_s=0.1)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            mark = " (pick)" if row["pick"] else ""
            log(f"sweep {name} M={m} {row['config']}{mark}: {fmt_us(row['us'])}")
            rows.append(row)
    return rows


def parse_shape(text: str) -> tuple[str, tuple[int, int, int, int]]:
    """``NAME=E,TOPK,H,I`` -> (NAME, (E, TOPK, H, I)), each a positive integer, TOPK <= E."""
    name, sep, dims = text.partition("=")
    parts = dims.split(",")
    if not sep or not name or len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--shape {text!r}: expected NAME=E,TOPK,H,I, e.g. mine=64,6,2048,1408")
    e, k, h, i = (int(p) for p in parts)
    if min(e, k, h, i) < 1 or k > e:
        raise ValueError(f"--shape {text!r}: E, TOPK, H, I must be positive with TOPK <= E")
    return name, (e, k, h, i)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"M in {QUICK_MS}")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--models", help="comma-separated names (default: all of the format's)")
    ap.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME=E,TOPK,H,I",
        help="time this MoE shape too (repeatable; H and I multiples of 64 for the mma kernels)",
    )
    ap.add_argument("--format", choices=sorted(FORMAT_ACT), default="nvfp4",
                    help="nvfp4: Qwen3 / Mixtral / DeepSeek shapes; mxfp4: gpt-oss")  # fmt: skip
    ap.add_argument("--sweep", action="store_true", help="then time alternative tile configs")
    ap.add_argument("--sweep-budget", type=float, default=90.0)
    ap.add_argument("--sweep-points", help="MODEL:M,... instead of the built-in sweep points")
    ap.add_argument(
        "--sweep-small",
        action="store_true",
        help="sweep only the single-pair kernels (top-k sum in the down kernel)",
    )
    ap.add_argument("--ms", help="comma-separated M values instead of the default list")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    ap.add_argument("--rebuild", type=Path, help="rescale the floors of a result JSON, no GPU")
    ap.add_argument("--bandwidth-tbps", type=float, help="with --rebuild: the bandwidth to use")
    ap.add_argument("--bandwidth-source", default="given with --bandwidth-tbps")
    peers.add_args(ap, default_ms="quick")
    args = ap.parse_args()
    if args.rebuild:
        rebuild(args.rebuild, args.bandwidth_tbps, args.bandwidth_source)
        return
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import triton

    smoke = args.smoke
    dev = torch.device("cpu" if smoke else "cuda")
    catalog = dict(MODELS if args.format == "nvfp4" else MX_MODELS)
    for text in args.shape:
        try:
            name, dims = parse_shape(text)
        except ValueError as exc:
            ap.error(str(exc))
        catalog[name] = dims
    unknown = set(args.models.split(",")) - set(catalog) if args.models else set()
    if unknown:
        ap.error(f"unknown {args.format} models {sorted(unknown)}; known: {', '.join(catalog)}")
    names = args.models.split(",") if args.models else list(catalog)
    models = SMOKE_MODELS if smoke else {k: catalog[k] for k in names}
    ms = SMOKE_MS if smoke else (QUICK_MS if args.quick else MS)
    if args.ms:
        ms = [int(v) for v in args.ms.split(",")]
    try:
        peers.parse_ms(args.marlin_ms, ms, QUICK_MS)
    except ValueError as exc:
        ap.error(str(exc))
    if args.sweep_points:
        pts = [p.rsplit(":", 1) for p in args.sweep_points.split(",")]
        SWEEP_POINTS[:] = [(name, int(m)) for name, m in pts]
    dev_name = "cpu-interpreter" if smoke else torch.cuda.get_device_name()
    slug = dev_name.lower().replace("nvidia ", "").replace(" ", "-")
    date = dt.date.today().isoformat()
    meta = {
        "device": dev_name,
        "capability": None if smoke else list(torch.cuda.get_device_capability()),
        "driver": "n/a" if smoke else driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        # register-operand wgmma launches settle each K step (kernels/common/wgmma_guard.py)
        "rs_wgmma_settled": torch.cuda.is_available()
        and device_facts(torch.device("cuda")).rs_wgmma_hazard,
        "date": date,
        "format": args.format,
        "models": models,
        "ms": ms,
        "routings_per_graph": ROUTINGS,
        "bound": BOUND,
    }
    t_start = time.time()
    bw = 0.0 if smoke else copy_bandwidth()
    meta["copy_bw_TBps"] = bw / 1e12
    log(f"{dev_name}: streaming bandwidth {bw / 1e12:.2f} TB/s")
    marlin = peers.setup(args, ms, QUICK_MS, "moe", skip="--smoke" if smoke else None)
    meta["marlin"] = marlin.meta
    gen = torch.Generator(device=dev).manual_seed(0)
    tag = "" if args.format == "nvfp4" else f"-{args.format}"
    base = out_dir / f"moe{tag}-{slug}-{date}"
    rows: list[dict] = []
    layers: dict[str, Layer] = {}
    for idx, (name, (e, k, h, i)) in enumerate(models.items()):
        layer = Layer(e, k, h, i, dev, seed=idx, fmt=args.format)
        meta["bf16_path"] = (
            "torch._grouped_mm on expert-sorted tokens"
            if layer.grouped
            else "per-expert torch.matmul loop (eager: it synchronizes)"
        )
        peer = marlin.moe(layer, name)
        for m in ms:
            rows += run_point(layer, name, m, gen, bw, graphs=not smoke,
                              marlin=peer if marlin.runs(m) else None)  # fmt: skip
        meta["seconds"] = round(time.time() - t_start, 1)
        # written after every model, so a run cut short keeps what it measured
        base.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        base.with_suffix(".md").write_text(markdown(meta, rows))
        if args.sweep and name in {p[0] for p in SWEEP_POINTS}:
            del layer.d13, layer.d2  # the sweep only runs the repacked path
            layers[name] = layer
        del layer, peer
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    log(markdown(meta, rows))
    if args.sweep and not smoke:
        srows = sweep(layers, gen, args.sweep_budget, args.sweep_small)
        (out_dir / f"moe{tag}-sweep-{slug}-{date}.json").write_text(
            json.dumps({"meta": meta, "rows": srows}, indent=1)
        )
    log(f"done in {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
