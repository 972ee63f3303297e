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

SHAPES = {
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
    "70b": [
        ("qkv", 10240, 8192),
        ("o", 8192, 8192),
        ("gate_up", 57344, 8192),
        ("down", 8192, 28672),
    ],
}
MS = [64, 128, 256, 512, 1024, 2048, 4096, 8192]
QUICK_MS = [64, 256, 1024, 4096]
CPU_SHAPES = {"tiny": [("tiny", 128, 256)]}
CPU_MS = [16, 40]
COLUMNS = ["bf16", "wo", "fp8", "fp8_res"]
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


# ---- report ---------------------------------------------------------------------------------


def crossover(rows: list[dict], model: str, name: str, col: str, base: str) -> int | None:
    """Smallest M from which ``col`` is faster than ``base`` at every larger M measured."""
    best = None
    for m, t in sorted(_times(rows, model, name).items(), reverse=True):
        a, b = t.get(col), t.get(base)
        if a is None or b is None or a >= b:
            break
        best = m
    return best


def _times(rows, model, name) -> dict[int, dict[str, float | None]]:
    out: dict[int, dict[str, float | None]] = {}
    for r in rows:
        if r["model"] == model and r["shape"] == name:
            out.setdefault(r["M"], {})[r["column"]] = r["us"]
    return out


def markdown(meta: dict, rows: list[dict]) -> str:
    o = [
        f"# FP8 prefill on {meta['device']} ({meta['date']})",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, driver "
        f"{meta['driver']}. NVFP4 weights (quantize_nvfp4 of N(0, 0.02), 1/64 of rows x1e-3: "
        "subnormal block scales), bf16 activations N(0, 1). Median us per call over CUDA-graph "
        "replays, weights and activations rotated past L2. bf16 = cuBLAS on the dequantized "
        "weight; wo = QuantLinear (triton backend, weight-only); fp8 = FP8 prefill "
        "re-encoding per call; res = FP8 prefill on a resident FP8 copy. err = ||y - y64|| / "
        "||y64|| on the first 512 rows, y64 = float64 x @ W^T (the W4A16 result); bound = max "
        "|y_fp8 - y64| / (proven componentwise bound), first 64 rows (<= 1 required).",
        "",
    ]
    for model in meta["models"]:
        o += [
            f"## {model}: speed-up over bf16 (wo / fp8 / res) and time (us)",
            "",
            "| shape | M | bf16 us | wo us | fp8 us | res us | wo | fp8 | res | fp8 vs wo |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, n, k in SHAPES.get(model, CPU_SHAPES.get(model, [])):
            for m, t in sorted(_times(rows, model, name).items()):
                cell = lambda c, t=t: f"{t[c]:.1f}" if t.get(c) else "FAIL"
                sp = lambda c, t=t: (
                    f"{t['bf16'] / t[c]:.2f}x" if t.get(c) and t.get("bf16") else "-"
                )
                vs = f"{t['wo'] / t['fp8']:.2f}x" if t.get("wo") and t.get("fp8") else "-"
                o.append(
                    f"| {name} {n}x{k} | {m} | {cell('bf16')} | {cell('wo')} | "
                    f"{cell('fp8')} | {cell('fp8_res')} | {sp('wo')} | {sp('fp8')} | "
                    f"{sp('fp8_res')} | {vs} |"
                )
        o += [
            "",
            f"## {model}: accuracy",
            "",
            "| shape | M | err bf16 | err wo | err fp8 | fp8 vs wo | bound | res == fp8 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, _, _ in SHAPES.get(model, CPU_SHAPES.get(model, [])):
            by = {
                (r["M"], r["column"]): r for r in rows if r["model"] == model and r["shape"] == name
            }
            for m in sorted({mm for mm, _ in by}):
                f = by.get((m, "fp8"), {})
                e = lambda c, m=m, by=by: f"{by[(m, c)]['err']:.2e}" if (m, c) in by else "-"
                o.append(
                    f"| {name} | {m} | {e('bf16')} | {e('wo')} | {e('fp8')} | "
                    f"{f.get('vs_wo', float('nan')):.2e} | "
                    f"{f.get('bound_ratio', float('nan')):.3f} | {f.get('res_equal')} |"
                )
        o += [
            "",
            f"## {model}: crossover M (the smallest M from which it is faster at every "
            "larger M measured; - = never)",
            "",
            "| shape | recipe | fp8 > bf16 | fp8 > wo | res > bf16 | res > wo | resident MB "
            "| re-encode us (TB/s) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, _, _ in SHAPES.get(model, CPU_SHAPES.get(model, [])):
            info = next((r for r in rows if r["model"] == model and r["shape"] == name), None)
            if info is None:
                continue
            c = [
                crossover(rows, model, name, a, b) or "-"
                for a, b in (("fp8", "bf16"), ("fp8", "wo"), ("fp8_res", "bf16"), ("fp8_res", "wo"))
            ]
            re_us = info.get("reencode_us")
            re_txt = f"{re_us:.1f} ({info['reencode_TBps']:.2f})" if re_us else "-"
            o.append(
                f"| {name} | {info['recipe']} | "
                + " | ".join(map(str, c))
                + f" | {info['resident_bytes'] / 1e6:.1f} | {re_txt} |"
            )
    o += ["", "## Targets (8B shapes: fp8 >= 1.5x bf16 for M >= 1024, >= 1.2x at M = 256)", ""]
    for line in meta.get("targets", []):
        o.append(f"- {line}")
    extra = [r for r in rows if r["column"] not in COLUMNS]
    if extra:
        o += [
            "",
            "## Extras (8B)",
            "",
            "| shape | M | column | us | err | bound / note |",
            "|---|---|---|---|---|---|",
        ]
        for r in extra:
            us = f"{r['us']:.1f}" if r.get("us") else "-"
            note = r.get("bound_ratio", r.get("equal_values", ""))
            o.append(
                f"| {r['shape']} | {r['M']} | {r['column']} | {us} | {r['err']:.2e} | {note} |"
            )
    if meta.get("gemm_notes"):
        o += ["", "GEMM forms that fell back: " + json.dumps(meta["gemm_notes"])]
    return "\n".join(o) + "\n"


def targets(rows: list[dict]) -> list[str]:
    out = []
    for name, _, _ in SHAPES["8b"]:
        t = _times(rows, "8b", name)
        for m, need in sorted(
            (m, 1.5 if m >= 1024 else 1.2) for m in t if m >= 256 and (m >= 1024 or m == 256)
        ):
            for col in ("fp8", "fp8_res"):
                a, b = t[m].get(col), t[m].get("bf16")
                if a and b:
                    sp = b / a
                    out.append(
                        f"{name} M={m} {col}: {sp:.2f}x (need {need}x) "
                        f"{'MET' if sp >= need else 'MISSED'}"
                    )
    return out


def write(out_dir: Path, meta: dict, rows: list[dict], t0: float) -> Path:
    from quantdispatch.kernels.native import fp8_prefill as fp8p

    meta["seconds"] = round(time.time() - t0, 1)
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
        models, ms = ["tiny"], CPU_MS
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
            for name, n, k in SHAPES.get(model, CPU_SHAPES.get(model, [])):
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
