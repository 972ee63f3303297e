#!/usr/bin/env python3
"""Side-by-side timing of the quantized linear kernels on one GPU, in one run.

Columns: triton NVFP4, triton MXFP4, triton FP8 W8A16 (per-channel), torch native FP8
(``fp8_scaled_mm_linear``, dynamic per-token), bf16 cuBLAS (``F.linear`` on the dequantized
weight), vLLM's Marlin NVFP4 / MXFP4 GEMMs through our marlin backend (benchmarks/peers.py;
``--marlin-lib DIR``, ``--marlin-ms``) and the NVFP4 weight-streaming floor (bytes that must move
/ copy bandwidth measured in this run). Every kernel is checked against a float64 reference
before it is timed; a failed check is recorded and the kernel is not timed.

Timing: median over CUDA-graph replays; each graph holds many calls that cycle through enough
weight and activation copies to exceed the L2 several times, so every call streams from HBM.

    PYTHONPATH=$PWD python3 benchmarks/linear.py [--quick] [--tune] [--out DIR]

``--tune`` first sweeps :func:`quantdispatch.kernels.common.configs.candidate_configs` per shape
and M (NVFP4 bf16; FP8 W8A16 for M <= 16), writes ``configs_<gpu>.json`` to the output folder and
uses it for the timed run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import peers  # benchmarks/peers.py: the Marlin columns
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantdispatch.kernels.checkpoint_layout.fp8 import fp8_weight_only_linear
from quantdispatch.kernels.checkpoint_layout.linear import fp4_linear
from quantdispatch.kernels.common import configs
from quantdispatch.kernels.common.configs import GemmConfig
from quantdispatch.kernels.common.device_facts import device_facts
from quantdispatch.kernels.native.scaled_mm import fp8_scaled_mm_linear, prepare_fp8_scaled_mm

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
QUICK_SHAPES = [s for s in SHAPES if s[0] in ("gate_up", "down")]
QUICK_MS = [1, 16, 64, 256, 1024]
TUNE_MS = [1, 16, 32, 64, 128, 256, 1024, 4096]  # other M use the nearest tuned bucket
ROTATE_BYTES = 256 << 20  # weights + activations cycled per graph: ~5x the H200's 50 MB L2
KERNELS = [
    "nvfp4",
    "nvfp4_deq",
    "nvfp4_auto",
    "mxfp4",
    "mxfp4_auto",
    "fp8_w8a16",
    "fp8_native",
    "bf16",
]
DEQ_MIN_M = 32  # the dequantize + cuBLAS column is only interesting from here on
# extra columns for the notes (not in the markdown ratios): NVFP4 through the fp32 decode
EXTRA_KERNELS = ["nvfp4_f32"]
BOUND = 1e-2  # bf16 outputs: see tests/numerics/test_checkpoint_layout_linear.py
DEVICE = "cuda"  # a CPU smoke run (interpreter) may switch this


def log(*a: object) -> None:
    print(*a, flush=True)


# ---- independent float64 decoders (format definitions; not the kernels' code) ----------------

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_f64(codes: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(_E2M1 + [-v for v in _E2M1], dtype=torch.float64, device=codes.device)
    return lut[codes.long()]


def e4m3_f64(bits: torch.Tensor) -> torch.Tensor:
    b = bits.long()
    e, m = (b >> 3) & 15, (b & 7).double()
    mag = torch.where(e == 0, m * 2.0**-9, torch.pow(2.0, (e - 7).double()) * (1 + m / 8))
    return torch.where((b & 0x80) != 0, -mag, mag)


def fp4_weight_f64(packed, scale_bits, group, e8m0, gscale):
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)
    w = e2m1_f64(codes)
    s = torch.pow(2.0, scale_bits.double() - 127) if e8m0 else e4m3_f64(scale_bits)
    w = (w.view(w.shape[0], -1, group) * s[:, :, None]).view(w.shape[0], -1)
    return w * gscale if gscale is not None else w


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf where out is not finite."""
    if not torch.isfinite(out).all():
        return math.inf
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


# ---- timing --------------------------------------------------------------------------------


def time_calls(calls: list[Callable[[], object]], replays: int) -> float:
    """Median microseconds per call over graph replays of all ``calls`` back to back."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    g.replay()
    torch.cuda.synchronize()
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


def time_rotated(calls: list[Callable[[], object]], m: int) -> float:
    """:func:`time_calls` of calls that each use their own copy of the operands (rotated past
    L2): at least 16 per graph below M = 1024, where one call is short."""
    want = len(calls) if m >= 1024 else max(len(calls), 16)
    return time_calls([calls[i % len(calls)] for i in range(want)], 5 if m >= 1024 else 10)


def copy_bandwidth() -> dict[str, float]:
    """Device-to-device streaming rate, bytes read + written per second (the floor's
    denominator), two ways: a copy (in a graph it may run on a copy engine) and an SM
    elementwise pass (x * 1 over fp32). The floor uses the faster of the two."""
    n = 2 << 30
    src = torch.empty(n // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    t0 = time.time()
    while time.time() - t0 < 1.0:  # let the clocks ramp up from idle (345 MHz seen at start)
        torch.mul(src, 1.0, out=dst)
        torch.cuda.synchronize()
    copy_us = time_calls([lambda: dst.copy_(src)] * 4, replays=20)
    sm_us = time_calls([lambda: torch.mul(src, 1.0, out=dst)] * 4, replays=20)
    return {"copy": 2 * n / (copy_us * 1e-6), "sm_elementwise": 2 * n / (sm_us * 1e-6)}


# ---- per-shape problem ---------------------------------------------------------------------


class Problem:
    """Weights of one shape in every format, rotated copies, and float64 reference weights."""

    def __init__(self, n: int, k: int, gen: torch.Generator):
        self.n, self.k = n, k
        dev = DEVICE

        def rint(lo, hi, shape):
            return torch.randint(lo, hi, shape, generator=gen, dtype=torch.uint8, device=dev)

        packed = rint(0, 256, (n, k // 2))
        nv_scale = rint(0x28, 0x7F, (n, k // 16))  # 2^-4 .. 448 (0x7F is NaN: excluded)
        nv_scale[: max(1, n // 64)] = rint(1, 8, (max(1, n // 64), k // 16))  # some subnormal
        self.gscale = torch.tensor(3e-3, dtype=torch.float32, device=dev)
        mx_scale = rint(118, 129, (n, k // 32))  # 2^-9 .. 2^1
        fp8 = rint(0, 256, (n, k))
        fp8[(fp8 & 0x7F) == 0x7F] = 0x3A
        self.fp8_scale = (torch.rand(n, generator=gen, device=dev) * 0.02 + 0.005).float()
        self.w64 = {
            "nvfp4": fp4_weight_f64(packed, nv_scale, 16, False, 3e-3),
            "mxfp4": fp4_weight_f64(packed, mx_scale, 32, True, None),
            "fp8": e4m3_f64(fp8) * self.fp8_scale.double()[:, None],
        }
        self.bf16 = self.w64["nvfp4"].to(torch.bfloat16)
        per_copy = n * k * 0.5625
        self.copies = max(2, math.ceil(ROTATE_BYTES / per_copy))
        self.nv = [
            (packed.clone(), nv_scale.view(torch.float8_e4m3fn).clone()) for _ in range(self.copies)
        ]
        self.mx = [(p, mx_scale.clone()) for p, _ in self.nv]
        self.fp8_copies = max(2, math.ceil(ROTATE_BYTES / (n * k)))
        fp8w = fp8.view(torch.float8_e4m3fn)
        self.fp8 = [fp8w.clone() for _ in range(self.fp8_copies)]
        self.fp8_native = [prepare_fp8_scaled_mm(w, self.fp8_scale) for w in self.fp8]
        self.bf16_copies = max(2, math.ceil(ROTATE_BYTES / (2 * n * k)))
        self.bf16s = [self.bf16.clone() for _ in range(self.bf16_copies)]

    def prepared_nvfp4(self) -> tuple[list[tuple[torch.Tensor, ...]], tuple]:
        """The rotated NVFP4 copies as TritonBackend.prepare lays them out on this GPU (the
        kernel tensors before the global scale), and its (layout, meta)."""
        if getattr(self, "_prepared", None) is None:
            from quantdispatch.backends.triton import TritonBackend
            from quantdispatch.formats.nvfp4 import Nvfp4Weight
            from quantdispatch.request import Request

            request = Request.make("nvfp4", "linear", torch.bfloat16, n=self.n, k=self.k)
            prepared = [
                TritonBackend().prepare(Nvfp4Weight(pk, sc, self.gscale), request)
                for pk, sc in self.nv
            ]
            self._prepared = (
                [w.tensors[:2] for w in prepared],
                (prepared[0].layout, prepared[0].meta),
            )
        return self._prepared

    def prepared_mxfp4(self) -> tuple[list[tuple[torch.Tensor, ...]], tuple]:
        """The rotated MXFP4 copies as TritonBackend.prepare lays them out on this GPU (all
        its tensors), and its (layout, meta)."""
        if getattr(self, "_prepared_mx", None) is None:
            from quantdispatch.backends.triton import TritonBackend
            from quantdispatch.formats.mxfp4 import Mxfp4Weight
            from quantdispatch.request import Request

            request = Request.make("mxfp4", "linear", torch.bfloat16, n=self.n, k=self.k)
            prepared = [TritonBackend().prepare(Mxfp4Weight(pk, sc), request) for pk, sc in self.mx]
            self._prepared_mx = (
                [w.tensors for w in prepared],
                (prepared[0].layout, prepared[0].meta),
            )
        return self._prepared_mx

    def xs(self, m: int, count: int, gen: torch.Generator) -> list[torch.Tensor]:
        x = torch.randn(m, self.k, generator=gen, device=DEVICE).to(torch.bfloat16)
        return [x.clone() for _ in range(count)]


def _deq_nvfp4(x, w, gscale):
    from quantdispatch.kernels.checkpoint_layout.dequant import dequant_fp4_rows
    from quantdispatch.kernels.common.slabs import dequant_gemm

    packed, scale = w[0], w[1].view(torch.uint8)

    def rows(a, b, out):
        dequant_fp4_rows(packed[a:b], scale[a:b], gscale, out, scale_format="e4m3")

    return dequant_gemm(x, packed.shape[0], packed.shape[1] * 2, rows)


def auto_family(p: Problem, kernel: str, m: int, facts) -> str | None:
    """The regime table's kernel family a QuantLinear call runs (the *_auto columns)."""
    if kernel not in ("nvfp4_auto", "mxfp4_auto"):
        return None
    from quantdispatch.backends.triton.dispatch import linear_family

    fmt = kernel.split("_")[0]
    try:
        layout, meta = (p.prepared_nvfp4() if fmt == "nvfp4" else p.prepared_mxfp4())[1]
    except Exception:  # the column failed already (logged there)
        return None
    return str(linear_family(fmt, layout, meta, m, p.n, p.k, facts))


def make_calls(p: Problem, kernel: str, m: int, gen, cfg: GemmConfig | None = None):
    """(list of rotated zero-arg calls, check call returning (out, ref64))."""
    if kernel in peers.LINEAR_KERNELS:
        return peers.linear_calls(p, kernel, m, gen)
    if kernel in ("nvfp4_deq", "nvfp4_auto"):
        from quantdispatch.backends.triton import TritonBackend

        backend = TritonBackend()
        xs = p.xs(m, p.copies, gen)
        if kernel == "nvfp4_deq":
            calls = [
                (lambda x=x, w=w: _deq_nvfp4(x, w, p.gscale)) for x, w in zip(xs, p.nv, strict=True)
            ]
        else:  # what QuantLinear runs: prepare's layout, then the backend picks the path by M
            from quantdispatch.backends.bound import LinearBinding

            weights, meta = p.prepared_nvfp4()
            dev = p.gscale.device
            binds = [
                LinearBinding((*w, p.gscale), None, "nvfp4", *meta, True, dev) for w in weights
            ]
            calls = [
                (lambda x=x, b=b: backend.linear(x, b)) for x, b in zip(xs, binds, strict=True)
            ]
        ref = lambda: xs[0].double() @ p.w64["nvfp4"].T
    elif kernel in ("nvfp4", "nvfp4_f32"):
        xs = p.xs(m, p.copies, gen)
        deq = False if kernel == "nvfp4_f32" else None
        calls = [
            (
                lambda x=x, w=w: fp4_linear(
                    x, w[0], w[1], p.gscale, scale_format="e4m3", config=cfg, deq16=deq
                )
            )
            for x, w in zip(xs, p.nv, strict=True)
        ]
        ref = lambda: xs[0].double() @ p.w64["nvfp4"].T
    elif kernel == "mxfp4_auto":  # what QuantLinear runs for an MXFP4 weight
        from quantdispatch.backends.bound import LinearBinding
        from quantdispatch.backends.triton import TritonBackend

        backend = TritonBackend()
        xs = p.xs(m, p.copies, gen)
        weights, meta = p.prepared_mxfp4()
        binds = [LinearBinding(tuple(w), None, "mxfp4", *meta, True, w[0].device) for w in weights]
        calls = [(lambda x=x, b=b: backend.linear(x, b)) for x, b in zip(xs, binds, strict=True)]
        ref = lambda: xs[0].double() @ p.w64["mxfp4"].T
    elif kernel == "mxfp4":
        xs = p.xs(m, p.copies, gen)
        calls = [
            (lambda x=x, w=w: fp4_linear(x, w[0], w[1], None, scale_format="e8m0", config=cfg))
            for x, w in zip(xs, p.mx, strict=True)
        ]
        ref = lambda: xs[0].double() @ p.w64["mxfp4"].T
    elif kernel == "fp8_w8a16":
        xs = p.xs(m, p.fp8_copies, gen)
        calls = [
            (
                lambda x=x, w=w: fp8_weight_only_linear(
                    x, w, p.fp8_scale, block_size=None, config=cfg
                )
            )
            for x, w in zip(xs, p.fp8, strict=True)
        ]
        ref = lambda: xs[0].double() @ p.w64["fp8"].T
    elif kernel == "fp8_native":
        xs = p.xs(m, p.fp8_copies, gen)
        calls = [
            (lambda x=x, w=w: fp8_scaled_mm_linear(x, w[0], w[1]))
            for x, w in zip(xs, p.fp8_native, strict=True)
        ]

        def ref():  # the same dynamic per-token quantization, emulated in float64
            x = xs[0].float()
            s = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
            xq = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn)
            return (e4m3_f64(xq.view(torch.uint8)) * s.double()) @ p.w64["fp8"].T
    else:
        xs = p.xs(m, p.bf16_copies, gen)
        calls = [(lambda x=x, w=w: F.linear(x, w)) for x, w in zip(xs, p.bf16s, strict=True)]
        ref = lambda: xs[0].double() @ p.w64["nvfp4"].T
    return calls, ref


def replays_for(m: int) -> int:
    return 8 if m >= 1024 else 20


def graph_calls(calls: list, m: int) -> list:
    """Enough calls per graph that launch gaps and warm-up edges average out."""
    want = len(calls) if m >= 1024 else max(len(calls), 32)
    return [calls[i % len(calls)] for i in range(want)]


def checked_time(p: Problem, kernel: str, m: int, gen, cfg=None) -> tuple[float | None, float]:
    calls, ref = make_calls(p, kernel, m, gen, cfg)
    err = rel_err(calls[0](), ref())
    if not err < BOUND:
        return None, err
    return time_calls(graph_calls(calls, m), replays_for(m)), err


# ---- tuning --------------------------------------------------------------------------------


def tune_shape(p: Problem, name: str, ms: list[int], gen, kinds: dict[str, list[int]]):
    winners = []
    for kind, kind_ms in kinds.items():
        kernel = "nvfp4" if kind == "nvfp4" else "fp8_w8a16"
        for m in ms:
            if m not in kind_ms:
                continue
            t0 = time.time()

            def run(cfg, m=m, kernel=kernel):
                calls, ref = make_calls(p, kernel, m, gen, cfg)
                run.calls, run.ref = calls, ref
                return calls[0]

            def timer(fn, m=m):
                return time_calls(graph_calls(run.calls, m)[:24], 6)

            def check(out):
                return rel_err(out, run.ref()) < BOUND

            cands = configs.candidate_configs(m, "fp8" if kind == "fp8" else "nvfp4")
            best, results = configs.tune(run, timer, cands, check)
            desc = ", ".join(
                f"{c.block_m}x{c.block_n}x{c.block_k}/w{c.num_warps}s{c.num_stages}"
                f"{'S' if c.swap_ab else ''}{'k' + str(c.split) if c.split else ''}="
                + (f"{r:.1f}" if isinstance(r, float) else r[:40])
                for c, r in results
            )
            log(f"tune {kind} {name} M={m}: best {best} ({time.time() - t0:.1f}s) | {desc}")
            if best is not None:
                winners.append((kind, p.n, p.k, m, best))
    return winners


# ---- main ----------------------------------------------------------------------------------


def driver_version() -> str:
    try:
        return (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
            .stdout.strip()
            .splitlines()[0]
        )
    except Exception:
        return "unknown"


def markdown(meta: dict, rows: list[dict]) -> str:
    by = {(r["shape"], r["M"], r["kernel"]): r for r in rows}
    out = [
        f"# Linear kernels on {meta['device']} ({meta['date']})",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}"
        + (" (register-operand wgmma settled each K step)" if meta.get("rs_wgmma_settled") else "")
        + f", driver {meta['driver']}, CUDA "
        f"{meta['cuda']}; streaming bandwidth {meta['copy_bw_TBps']:.2f} TB/s (read+write, the "
        "faster of a copy and an SM elementwise pass). "
        "Median us per call over CUDA-graph replays, weights and activations rotated past L2; "
        "every kernel checked against float64 first (FAIL = not timed). bf16 activations. "
        "floor = NVFP4 bytes (packed + e4m3 scales + x + out) / copy bandwidth.",
        "",
        "NVFP4 = the fused tl.dot Triton kernels on the checkpoint layout; NVFP4 deq = dequantize "
        "slabs + cuBLAS; NVFP4 auto = what QuantLinear runs: the weight as the triton backend "
        "prepares it on this GPU (mma16x64 on SM 8.0+); on SM 9.x the mma.sync PTX kernel up "
        "to M = 32 (16 for weights of 2^25+ elements: gate_up, down), the tl.dot (wgmma) GEMM "
        "decoding the same weight up to M = 512 (256 below 2^25 elements), larger M dequantized "
        "slabs + cuBLAS (SM 8.x: the mma kernel up to M = 64 / 128, then dequantize). MXFP4 = "
        "the tl.dot kernels on the checkpoint layout; MXFP4 auto = what QuantLinear runs: the "
        "same mma16x64 paths, its E8M0 scales re-encoded (scales spanning <= 18 binades).",
        "",
        *([peers.linear_note(meta), ""] if "marlin" in meta else []),
        "| shape | N x K | M | NVFP4 | NVFP4 deq | NVFP4 auto | MXFP4 | MXFP4 auto | FP8 W8A16 "
        "| FP8 native | bf16 | floor | bf16/auto | auto/floor |" + peers.linear_head(meta)[0],
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + peers.linear_head(meta)[1],
    ]
    for name, n, k in meta["shapes"]:
        for m in meta["ms"]:
            cells = []
            for kern in KERNELS:
                r = by.get((name, m, kern))
                cells.append(
                    "-" if r is None else ("FAIL" if r["us"] is None else f"{r['us']:.1f}")
                )
            nv, bf = by.get((name, m, "nvfp4_auto")), by.get((name, m, "bf16"))
            floor = (nv or bf or {}).get("floor_us")
            ok = nv and bf and nv["us"] and bf["us"]
            r1 = f"{bf['us'] / nv['us']:.2f}x" if ok else "-"
            r2 = f"{nv['us'] / floor:.2f}x" if nv and nv["us"] and floor else "-"
            fl = f"{floor:.1f}" if floor else "-"
            out.append(
                f"| {name} | {n}x{k} | {m} | "
                + " | ".join(cells)
                + f" | {fl} | {r1} | {r2} |"
                + peers.linear_cells(meta, by, name, m)
            )
    return "\n".join(out) + "\n"


def write_results(out_dir: Path, slug: str, date: str, meta: dict, rows: list, t0: float) -> str:
    meta["seconds"] = round(time.time() - t0, 1)
    base = out_dir / f"linear-{slug}-{date}"
    base.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    md = markdown(meta, rows)
    base.with_suffix(".md").write_text(md)
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="gate_up/down shapes, 5 M values")
    ap.add_argument("--tune", action="store_true", help="sweep configs first, write the table")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--kernels", default=",".join(KERNELS + EXTRA_KERNELS + peers.LINEAR_KERNELS))
    ap.add_argument("--ms", help="comma-separated M values instead of the default list")
    ap.add_argument("--tune-kinds", default="nvfp4,fp8", help="with --tune: which tables to sweep")
    peers.add_args(ap, default_ms="all")
    args = ap.parse_args()
    unknown = set(args.tune_kinds.split(",")) - {"nvfp4", "fp8"}
    if unknown:
        ap.error(f"--tune-kinds {args.tune_kinds!r}: unknown {sorted(unknown)}; use nvfp4,fp8")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    ms = QUICK_MS if args.quick else MS
    if args.ms:
        ms = [int(v) for v in args.ms.split(",")]
    kernels = args.kernels.split(",")
    try:
        peers.parse_ms(args.marlin_ms, ms, QUICK_MS)
    except ValueError as exc:
        ap.error(str(exc))
    import triton

    dev_name = torch.cuda.get_device_name()
    slug = dev_name.lower().replace("nvidia ", "").replace(" ", "-")
    date = dt.date.today().isoformat()
    meta = {
        "device": dev_name,
        "capability": list(torch.cuda.get_device_capability()),
        "driver": driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        # register-operand wgmma launches settle each K step (kernels/common/wgmma_guard.py)
        "rs_wgmma_settled": torch.cuda.is_available()
        and device_facts(torch.device("cuda")).rs_wgmma_hazard,
        "date": date,
        "shapes": shapes,
        "ms": ms,
        "rotate_bytes": ROTATE_BYTES,
        "bound": BOUND,
    }
    t_start = time.time()
    bws = copy_bandwidth()
    bw = max(bws.values())
    meta["copy_bw_TBps"] = bw / 1e12
    meta["bandwidths_TBps"] = {k: v / 1e12 for k, v in bws.items()}
    marlin = None
    if set(peers.LINEAR_KERNELS) & set(kernels):
        marlin = peers.setup(args, ms, QUICK_MS, "linear")
        meta["marlin"] = marlin.meta
    log(
        f"{dev_name}: streaming bandwidth "
        + ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in bws.items())
    )
    gen = torch.Generator(device="cuda").manual_seed(0)

    if args.tune:
        winners = []
        for name, n, k in shapes:
            p = Problem(n, k, gen)
            tms = [m for m in ms if m in TUNE_MS]
            kinds = {"nvfp4": tms, "fp8": [m for m in tms if m <= 16]}
            kinds = {kk: v for kk, v in kinds.items() if kk in args.tune_kinds.split(",")}
            winners += tune_shape(p, name, tms, gen, kinds)
            del p
            torch.cuda.empty_cache()
        table = configs.table_from_results(dev_name, winners)
        (out_dir / f"configs_{slug}.json").write_text(json.dumps(table, indent=1) + "\n")
        configs.register_table(table)
        log(f"tuning done in {time.time() - t_start:.0f}s")

    rows = []
    for name, n, k in shapes:
        p = Problem(n, k, gen)
        for m in ms:
            floor = (n * k * 0.5625 + 2 * m * k + 2 * m * n) / bw * 1e6
            line = []
            for kern in kernels:
                if kern == "nvfp4_deq" and m < DEQ_MIN_M:
                    continue
                if kern in peers.LINEAR_KERNELS and not (marlin and marlin.runs(m)):
                    continue
                kind = {
                    "nvfp4": "nvfp4",
                    "nvfp4_f32": "nvfp4",
                    "mxfp4": "mxfp4",
                    "fp8_w8a16": "fp8",
                }.get(kern)
                facts = device_facts(torch.device(DEVICE))
                src = configs.get_config(kind, facts, n, k, m) if kind else None
                try:
                    us, err = checked_time(p, kern, m, gen)
                except Exception as exc:  # keep the other columns
                    us, err = None, math.nan
                    log(f"  {name} M={m} {kern}: {type(exc).__name__}: {str(exc)[:300]}")
                rows.append(
                    {
                        "shape": name,
                        "N": n,
                        "K": k,
                        "M": m,
                        "kernel": kern,
                        "us": us,
                        "rel_err": err,
                        "floor_us": floor,
                        "config": src[0].to_dict() if src else None,
                        "config_source": src[1] if src else None,
                        "family": auto_family(p, kern, m, facts),
                    }
                )
                line.append(f"{kern}={'FAIL' if us is None else f'{us:.1f}'}(e={err:.1e})")
            log(f"{name} {n}x{k} M={m} floor={floor:.1f}: " + " ".join(line))
        del p
        torch.cuda.empty_cache()
        write_results(out_dir, slug, date, meta, rows, t_start)  # partial results survive a kill
    md = write_results(out_dir, slug, date, meta, rows, t_start)
    log(md)


if __name__ == "__main__":
    main()
