#!/usr/bin/env python3
"""FP8 prefill (FP4 weights on FP8 tensor cores) against bf16 cuBLAS and our weight-only path.

Per shape (Llama-3-8B and -70B linear layers) and M: the output error of each path against
the float64 W4A16 result (x @ dequantized W) and of FP8 against the weight-only output, the
largest ratio of the FP8 error to its proven componentwise bound (must be <= 1), and the time
of bf16 cuBLAS on the dequantized weight, the weight-only path QuantLinear runs (triton
backend), FP8 prefill re-encoding the weight per call, and FP8 prefill on a resident FP8 copy.
Every output is checked before it is timed (a failing path is not timed). Then the crossover M
per shape, the issue's targets (8B shapes: >= 1.5x bf16 from M = 1024, >= 1.2x at M = 256),
and extras: re-encoder and activation-quantizer rates, the 1x128 weight recipe, slab sizes, the
mma16x64-layout path (re-encoded from the layout the triton backend holds), MXFP4.

Timing as benchmarks/linear.py: median us per call over CUDA-graph replays, weights and
activations rotated past L2. Writes fp8-prefill-<gpu>-<date>.json / .md under --out.

    PYTHONPATH=$PWD python3 benchmarks/fp8_prefill.py [--quick] [--out DIR]
    PYTHONPATH=$PWD python3 benchmarks/fp8_prefill.py --device cpu --quick   # smoke test
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from fp8_prefill_report import COLUMNS, SHAPES  # benchmarks/fp8_prefill_report.py

MS = [64, 128, 256, 512, 1024, 2048, 4096, 8192]
QUICK_MS = [64, 256, 1024, 4096]
CPU_MS = [16, 40]
EXTRA_MS = [1024, 4096]  # recipe / slab / mma-path / MXFP4 extras
ROTATE_BYTES = 256 << 20
CHECK_ROWS = 512  # rows of x compared with float64 (all rows for smaller M)
BOUND_ROWS = 64  # rows checked against the componentwise bound
REL_BOUND = {"bf16": 1e-2, "wo": 1e-2}  # 16-bit paths; FP8 must meet its componentwise bound
DEV = "cuda"
IMPL = "triton"  # the CPU smoke run uses the plain-torch rule (same bits, interpreter too slow)


def log(*a: object) -> None:
    print(*a, flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out.double()
    if not bool(torch.isfinite(o).all()):
        return math.inf
    return float((o - ref).norm() / ref.norm())


def bound_ratio(x, w64, y, fmt, recipe, res) -> float:
    """max |y - x w^T| / bound over the rows given: per element |x^ - x| <= max(|x|/17,
    2^-10 s_x), |w^ - w| <= max(|w|/21, 2^-10 s_w) (docs/design/fp8-prefill.md), plus 2^-10
    of sum |x^ w^| (accumulation) and 2^-8 |y| (16-bit output)."""
    from quantdispatch.kernels.native import fp8_prefill as fp8p

    k = x.shape[1]
    _, sa = fp8p.quantize_activations(x, recipe, IMPL)
    bc_a = k if recipe == "rowwise" else 128
    sx = sa[: x.shape[0]].double().repeat_interleave(bc_a, 1)
    br, bc = fp8p.weight_blocks(recipe, k)
    sw = res.scale.double().repeat_interleave(br, 0)[: w64.shape[0]].repeat_interleave(bc, 1)
    xd = x.double()
    ref = xd @ w64.T
    ax, aw = xd.abs(), w64.abs()
    ex = torch.maximum(ax / 17, 2.0**-10 * sx)
    ew = torch.maximum(aw / 21, 2.0**-10 * sw)
    del sw
    bound = ex @ (aw + ew).T + ax @ ew.T + 2.0**-10 * ((ax + ex) @ (aw + ew).T)
    bound += 2.0**-8 * ref.abs() + 2.0**-24
    return float(((y.double() - ref).abs() / bound).max())


# ---- timing --------------------------------------------------------------------------------


def time_us(calls: list, m: int) -> float:
    if DEV == "cpu":  # the check call before warmed it up
        t = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - t) * 1e6
    import linear as L  # benchmarks/linear.py: the graph timing all our tables use

    want = len(calls) if m >= 1024 else max(len(calls), 16)
    return L.time_calls([calls[i % len(calls)] for i in range(want)], 5 if m >= 1024 else 10)


def cpu_scaled_mm(
    a,
    b,
    scale_a,
    scale_b,
    bias=None,
    scale_result=None,
    out_dtype=None,
    use_fast_accum=False,
    out=None,
):
    """torch._scaled_mm for the CPU smoke run: dequantize the operands, one fp32 matmul."""
    k, n = b.shape
    sa = scale_a.float().repeat_interleave(k // scale_a.shape[1], 1)
    sb = scale_b.float().repeat_interleave(k // scale_b.shape[0], 0)
    sb = sb.repeat_interleave(-(-n // sb.shape[1]), 1)[:, :n]
    y = (a.float() * sa) @ (b.float() * sb)
    if bias is not None:
        y = y + bias.float()
    y = y.to(out_dtype)
    return out.copy_(y) if out is not None else y


# ---- one shape ------------------------------------------------------------------------------


class Shape:
    """One weight in every form the columns need, rotated copies past L2."""

    def __init__(self, n: int, k: int, fmt: str, recipe: str):
        from quantdispatch.formats.mxfp4 import dequantize_mxfp4, quantize_mxfp4
        from quantdispatch.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
        from quantdispatch.kernels.native import fp8_prefill as fp8p

        self.n, self.k, self.fmt, self.recipe = n, k, fmt, recipe
        g = torch.Generator(device=DEV).manual_seed(n * 31 + k)
        w = torch.randn(n, k, generator=g, device=DEV) * 0.02
        w[: max(1, n // 64)] *= 1e-3  # rows whose NVFP4 block scales are e4m3 subnormals
        q = quantize_nvfp4(w) if fmt == "nvfp4" else quantize_mxfp4(w)
        del w
        self.q = q
        deq = dequantize_nvfp4 if fmt == "nvfp4" else dequantize_mxfp4
        self.w64 = deq(q, dtype=torch.float64)
        self.copies = max(2, math.ceil(ROTATE_BYTES / (n * k * 0.5625)))
        self.sf = q.block_scale.view(torch.uint8)
        self.gs = q.global_scale if fmt == "nvfp4" else None
        self.fp4 = [(q.packed.clone(), self.sf.clone()) for _ in range(self.copies)]
        self.res = [
            fp8p.make_resident(p, s, self.gs, fmt=fmt, recipe=recipe, impl=IMPL)
            for p, s in self.fp4[: max(2, math.ceil(ROTATE_BYTES / (n * k)))]
        ]
        wb = self.w64.to(torch.bfloat16)
        self.bf16 = [wb.clone() for _ in range(max(2, math.ceil(ROTATE_BYTES / (2 * n * k))))]
        self._layers = None

    def layers(self):
        """QuantLinear copies as the triton backend prepares them (the CPU smoke run: whatever
        the resolver picks there)."""
        if self._layers is None:
            from quantdispatch.api import load_settings
            from quantdispatch.layers import QuantLinear

            settings = load_settings({}, backend={self.fmt: "triton"}) if DEV == "cuda" else None
            from quantdispatch.formats.mxfp4 import Mxfp4Weight
            from quantdispatch.formats.nvfp4 import Nvfp4Weight

            def weight(p, s):
                if self.fmt == "nvfp4":
                    return Nvfp4Weight(p, s.view(torch.float8_e4m3fn), self.gs)
                return Mxfp4Weight(p, s)

            self._layers = [
                QuantLinear(weight(p, s), act_dtype=torch.bfloat16, device=DEV, settings=settings)
                for p, s in self.fp4
            ]
        return self._layers

    def calls(self, column: str, xs: list, recipe: str | None = None, ws: int | None = None):
        import torch.nn.functional as F

        from quantdispatch.kernels.native import fp8_prefill as fp8p

        recipe = recipe or self.recipe
        kw = {"impl": IMPL} if DEV == "cuda" else {"capability": (9, 0), "impl": IMPL}
        if ws is not None:
            kw["workspace_bytes"] = ws
        if column == "bf16":
            return [
                (lambda x=x, w=w: F.linear(x, w)) for x, w in zip(xs, self.bf16 * 64, strict=False)
            ]
        if column == "wo":
            return [
                (lambda x=x, lay=lay: lay(x))
                for x, lay in zip(xs, self.layers() * 64, strict=False)
            ]
        if column == "fp8_res":
            return [
                (
                    lambda x=x, r=r, p=p: fp8p.fp8_prefill_linear(
                        x, p[0], p[1], self.gs, fmt=self.fmt, resident=r, **kw
                    )
                )
                for x, r, p in zip(xs, self.res * 64, self.fp4, strict=False)
            ]
        if column == "fp8_mma":
            return self._mma_calls(xs, recipe, kw)
        return [
            (
                lambda x=x, p=p: fp8p.fp8_prefill_linear(
                    x, p[0], p[1], self.gs, fmt=self.fmt, recipe=recipe, **kw
                )
            )
            for x, p in zip(xs, self.fp4 * 64, strict=False)
        ]

    def _mma_calls(self, xs, recipe, kw):
        """The mma16x64 layout (what the triton backend holds on SM 8.0+), re-encoded straight
        from its words."""
        from quantdispatch.kernels.native import fp8_prefill as fp8p

        kw = {a: b for a, b in kw.items() if a != "impl"}
        calls = []
        for x, lay in zip(xs, self.layers() * 64, strict=False):
            t = (lay.mma_words, lay.mma_scales, lay.global_scale)
            calls.append(
                lambda x=x, t=t: fp8p.fp8_prefill_linear_mma(
                    x, *t, fmt=self.fmt, recipe=recipe, **kw
                )
            )
        return calls


def check_and_time(sh: Shape, column: str, m: int, xs, ref, rows: int, **kw) -> dict:
    calls = sh.calls(column, xs, **kw)
    y = calls[0]()
    r = {"column": column, "M": m, "err": rel_err(y[:rows], ref)}
    if column.startswith("fp8"):
        r["ok"] = r["err"] < 0.1  # gross failures; the bound ratio is the real check
    else:
        r["ok"] = r["err"] < REL_BOUND[column]
    r["us"] = time_us(calls, m) if r["ok"] else None
    r["out"] = y[:rows]
    return r


def run_shape(model: str, name: str, n: int, k: int, ms: list[int], args, rows_out: list):
    from quantdispatch.kernels.native import fp8_prefill as fp8p

    cap = torch.cuda.get_device_capability() if DEV == "cuda" else (9, 0)
    recipe = fp8p.default_recipe(k, cap) if DEV == "cuda" else "rowwise"
    t0 = time.time()
    sh = Shape(n, k, "nvfp4", recipe)
    g = torch.Generator(device=DEV).manual_seed(k)
    info = {
        "model": model,
        "shape": name,
        "N": n,
        "K": k,
        "recipe": recipe,
        "resident_bytes": sh.res[0].nbytes(),
        "fp4_bytes": sh.q.nbytes(),
    }
    if DEV == "cuda":  # the re-encoder alone, the whole weight
        ws = torch.empty((n, k), dtype=torch.uint8, device=DEV)
        p, s = sh.fp4[0]
        us = time_us(
            [lambda gs=sh.gs: fp8p.reencode_rows(p, s, gs, fmt="nvfp4", recipe=recipe, q=ws)],
            4096,
        )
        info["reencode_us"] = us
        info["reencode_TBps"] = n * k * (1 + 0.5625) / (us * 1e-6) / 1e12
    extras = args.extras and model == "8b"
    for m in ms:
        x = torch.randn(m, k, generator=g, device=DEV).to(torch.bfloat16)
        xs = [x] + [x.clone() for _ in range(min(sh.copies, 64) - 1)]
        rows = min(m, CHECK_ROWS)
        ref = x[:rows].double() @ sh.w64.T
        cols = {}
        for c in COLUMNS:
            cols[c] = check_and_time(sh, c, m, xs, ref, rows)
        fp8 = cols["fp8"]
        b = min(m, BOUND_ROWS)
        fp8["bound_ratio"] = bound_ratio(x[:b], sh.w64, fp8["out"][:b], "nvfp4", recipe, sh.res[0])
        fp8["vs_wo"] = rel_err(fp8["out"], cols["wo"]["out"].double())
        fp8["res_equal"] = bool(torch.equal(fp8["out"], cols["fp8_res"]["out"]))
        if extras and m in EXTRA_MS:
            if recipe == "128x128":
                cols["fp8_1x128"] = check_and_time(sh, "fp8", m, xs, ref, rows, recipe="1x128")
                cols["fp8_1x128"]["column"] = "fp8_1x128"
            if hasattr(sh.layers()[0], "mma_words"):
                cols["fp8_mma"] = check_and_time(sh, "fp8_mma", m, xs, ref, rows)
                cols["fp8_mma"]["equal_values"] = bool(
                    torch.equal(cols["fp8_mma"]["out"].float(), fp8["out"].float())
                )
            if name == "gate_up":
                for mib in (16, 32, 128, 256):
                    r = check_and_time(sh, "fp8", m, xs, ref, rows, ws=mib << 20)
                    r["column"] = f"fp8_slab{mib}MiB"
                    cols[r["column"]] = r
        if DEV == "cuda":
            cols["actq"] = {
                "column": "actq",
                "M": m,
                "err": 0.0,
                "ok": True,
                "us": time_us([lambda x=x: fp8p.quantize_activations(x, recipe)], m),
            }
        for r in cols.values():
            r.pop("out", None)
            rows_out.append({**info, **r})
        line = " ".join(
            f"{c}={cols[c]['us']:.1f}us/{cols[c]['err']:.1e}" if cols[c]["us"] else f"{c}=FAIL"
            for c in COLUMNS
        )
        log(f"{model} {name} M={m}: {line} bound={fp8['bound_ratio']:.3f}")
        del xs, x, ref
    if extras:  # MXFP4: the same weights in MXFP4, error and FP8 time
        mx = Shape(n, k, "mxfp4", recipe)
        for m in EXTRA_MS[:1] if args.quick else EXTRA_MS:
            x = torch.randn(m, k, generator=g, device=DEV).to(torch.bfloat16)
            rows = min(m, CHECK_ROWS)
            ref = x[:rows].double() @ mx.w64.T
            r = check_and_time(mx, "fp8", m, [x, x.clone()], ref, rows)
            b = min(m, BOUND_ROWS)
            r["bound_ratio"] = bound_ratio(
                x[:b], mx.w64, r.pop("out")[:b], "mxfp4", recipe, mx.res[0]
            )
            r["column"] = "mxfp4_fp8"
            rows_out.append({**info, **r})
        del mx
    log(f"  {model} {name}: {time.time() - t0:.1f}s")
    del sh
    if DEV == "cuda":
        torch.cuda.empty_cache()


def write(out_dir: Path, meta: dict, rows: list[dict], t0: float) -> Path:
    from quantdispatch.kernels.native import fp8_prefill as fp8p

    meta["seconds"] = round(time.time() - t0, 1)
    from fp8_prefill_report import markdown, targets

    meta["targets"] = targets(rows)
    meta["gemm_notes"] = fp8p.gemm_notes()
    slug = meta["device"].lower().replace("nvidia ", "").replace(" ", "-")
    base = out_dir / f"fp8-prefill-{slug}-{meta['date']}"
    base.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    base.with_suffix(".md").write_text(markdown(meta, rows))
    return base


def main(argv: list[str] | None = None) -> Path:
    global DEV, ROTATE_BYTES, IMPL
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8B shapes, M = 64, 256, 1024, 4096")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument(
        "--models", default=None, help="comma list of 8b,70b (default: both; quick: 8b)"
    )
    ap.add_argument("--ms", default=None, help="comma-separated M values")
    ap.add_argument("--no-extras", dest="extras", action="store_false")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="start no new shape after this many seconds (results so far are kept)",
    )
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    DEV = args.device
    if DEV == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import triton

    t0 = time.time()
    if DEV == "cpu":
        models, ms = ["tiny"], CPU_MS  # SHAPES["tiny"]: one small weight
        args.extras, ROTATE_BYTES, IMPL = False, 0, "torch"
    else:
        import linear as L

        models = (args.models or ("8b" if args.quick else "8b,70b")).split(",")
        ms = QUICK_MS if args.quick else MS
        L.copy_bandwidth()  # clocks up from idle before the first timing
    if args.ms:
        ms = [int(v) for v in args.ms.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
        "date": dt.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "driver": __import__("linear").driver_version() if DEV == "cuda" else "-",
        "models": models,
        "ms": ms,
        "quick": args.quick,
    }
    rows: list[dict] = []
    scaled_mm = torch._scaled_mm
    if DEV == "cpu":
        torch._scaled_mm = cpu_scaled_mm  # type: ignore[assignment]  # smoke run only
    try:
        for model in models:
            for name, n, k in SHAPES[model]:
                if time.time() - t0 > args.budget_s:
                    log(f"budget of {args.budget_s}s spent: skipping {model} {name}")
                    continue
                run_shape(model, name, n, k, ms, args, rows)
                write(out_dir, meta, rows, t0)  # after every shape: a kill keeps the results
    finally:
        torch._scaled_mm = scaled_mm
    base = write(out_dir, meta, rows, t0)
    for line in meta["targets"]:
        log(line)
    log(f"wrote {base}.md / .json in {meta['seconds']}s")
    return base


if __name__ == "__main__":
    main()
