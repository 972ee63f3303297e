#!/usr/bin/env python3
"""FP8 prefill's GEMM and activation quantizer, piece by piece, on the GPU.

Per shape and M, on the same e4m3 operands (an NVFP4 weight re-encoded 128x128, activations
quantized 1x128): bf16 cuBLAS on the dequantized weight; cuBLAS's block-scaled FP8 GEMM (what
``torch._scaled_mm`` runs for the 128x128 recipe); cuBLAS's row-wise and per-tensor FP8 GEMMs
(unit scales: the same tensor-core work with the scales in the epilogue only, the ceiling for
block scaling); our Triton block-scaled GEMM (fp8_block_gemm_triton.py here, an experiment)
for each tile in TILES; the activation quantizer with integer and with hardware rounding, in
several program shapes (QUANT); and the whole FP8 path (quantizer + the fastest Triton tile, and
quantizer + cuBLAS) as one call.

Checks before timing: the Triton outputs against cuBLAS's block-scaled output (same operands;
only the summation order differs), cuBLAS's block output against float64 on 64 rows, the
row-wise and per-tensor outputs against float64 of the unscaled operands, the two quantizers
bit-equal. Timing as benchmarks/linear.py (median of CUDA-graph replays, operands rotated past
L2). Writes fp8-gemm-sweep-<gpu>-<date>.json / .md under --out.

    PYTHONPATH=$PWD python3 benchmarks/probes/fp8_gemm_sweep.py [--models 8b,70b] [--ms 256,1024]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # probes/: fp8_block_gemm_triton.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from fp8_block_gemm_triton import BlockGemmTile
from fp8_prefill_report import SHAPES
from linear import rel_err as rel
from linear import time_rotated as timed

T = BlockGemmTile
TILES = [
    T(128, 128, 4, 8), T(128, 128, 5, 8), T(64, 128, 4, 4), T(128, 128, 4, 8, 16),
    T(128, 128, 4, 8, tma=False), T(64, 128, 4, 4, tma=False),
]  # fmt: skip
#: activation quantizer variants: (rows per program, warps)
QUANT = [(16, 4), (32, 4), (32, 8), (64, 8), (8, 4), (16, 2)]
ROTATE_BYTES = 256 << 20


def log(*a: object) -> None:
    print(*a, flush=True)


def run_shape(model, name, n, k, ms, rows):
    from quantdispatch.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
    from quantdispatch.kernels.native import fp8_prefill as fp8p

    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, generator=g, device="cuda") * 0.02
    q = quantize_nvfp4(w)
    del w
    copies = max(2, min(8, math.ceil(ROTATE_BYTES / (n * k))))
    sf = q.block_scale.view(torch.uint8)
    res = [
        fp8p.make_resident(q.packed, sf, q.global_scale, fmt="nvfp4", recipe="128x128")
        for _ in range(copies)
    ]
    wb = [dequantize_nvfp4(q, dtype=torch.bfloat16) for _ in range(copies)]
    w64 = res[0].q.double()  # the e4m3 codes' values, unscaled
    sb64 = res[0].scale.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    w = (q, sf, res, wb, w64, sb64, copies)
    for m in ms:
        rows.append(one_m(model, name, n, k, m, g, w))
    del w, res, wb, w64, sb64
    torch.cuda.empty_cache()


def one_m(model, name, n, k, m, g, weight) -> dict:
    from fp8_block_gemm_triton import fp8_block_gemm

    from quantdispatch.kernels.native import fp8_prefill as fp8p
    from quantdispatch.kernels.native.fp8_prefill_quant import quantize_blocks_triton

    q, sf, res, wb, w64, sb64, copies = weight
    one = torch.ones((), device="cuda")
    t0 = time.time()
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    xs = [x] + [x.clone() for _ in range(copies - 1)]
    quant = [fp8p.quantize_activations(xx, "128x128") for xx in xs]
    xq, sa = quant[0]
    mp = xq.shape[0]
    r = {"model": model, "shape": name, "N": n, "K": k, "M": m, "cols": {}}
    cols = r["cols"]
    # float64 of 64 rows: block-scaled, and unscaled (row-wise / per-tensor with unit scales)
    sa64 = sa[:64].double().repeat_interleave(128, 1)
    a64 = xq[:64].double()
    ref_block = (a64 * sa64) @ (w64 * sb64).T
    ref_unit = a64 @ w64.T
    rs_a = torch.ones((mp, 1), device="cuda")
    rs_b = torch.ones((1, n), device="cuda")

    def cublas_block(i):
        a, s = quant[i]
        return torch._scaled_mm(a, res[i].q.t(), s, res[i].scale.t(), out_dtype=torch.bfloat16)

    def cublas_row(i):
        a, _ = quant[i]
        return torch._scaled_mm(a, res[i].q.t(), rs_a, rs_b, out_dtype=torch.bfloat16)

    def cublas_tensor(i):
        a, _ = quant[i]
        return torch._scaled_mm(a, res[i].q.t(), one, one, out_dtype=torch.bfloat16,
                                use_fast_accum=True)  # fmt: skip

    y_block = cublas_block(0)
    checks = {
        "cublas_block": rel(y_block[:64], ref_block),
        "cublas_row": rel(cublas_row(0)[:64], ref_unit),
        "cublas_tensor": rel(cublas_tensor(0)[:64], ref_unit),
    }
    cand = {
        "bf16": lambda i: F.linear(xs[i], wb[i]),
        "cublas_block": cublas_block,
        "cublas_row": cublas_row,
        "cublas_tensor": cublas_tensor,
    }
    for c, f in cand.items():
        ok = c == "bf16" or checks[c] < 2e-2
        cols[c] = {
            "err": checks.get(c),
            "us": timed([lambda i=i, f=f: f(i) for i in range(copies)], m) if ok else None,
        }
    # the quantizer: integer vs hardware rounding, program shapes; all bit-equal
    outs = {}
    variants = [("actq_int", False, (16, 4))] + [
        (f"actq_hw_r{r_}w{w_}", True, (r_, w_)) for r_, w_ in QUANT
    ]
    for lab, hw, (rpp, nw) in variants:
        kw = {"hw": hw, "rows_per_program": rpp, "num_warps": nw}
        qa = torch.empty((mp, k), dtype=torch.uint8, device="cuda")
        s = torch.empty((k // 128, mp), device="cuda").t()
        quantize_blocks_triton(x, qa, s, **kw)
        outs[lab] = (qa, s)

        def call(i, kw=kw):
            qq = torch.empty((mp, k), dtype=torch.uint8, device="cuda")
            ss = torch.empty((k // 128, mp), device="cuda").t()
            quantize_blocks_triton(xs[i], qq, ss, **kw)

        cols[lab] = {"us": timed([lambda i=i: call(i) for i in range(copies)], m)}
    base_q = outs["actq_int"]
    r["actq_equal"] = all(
        torch.equal(v[0], base_q[0]) and torch.equal(v[1], base_q[1]) for v in outs.values()
    )
    best_q = min((c for c in cols if c.startswith("actq_hw")), key=lambda c: cols[c]["us"])
    cols["actq_hw"] = {**cols[best_q], "variant": best_q}
    log("  actq: " + " ".join(f"{lab}={cols[lab]['us']:.1f}" for lab, _, _ in variants))
    # our tiles
    best = None
    for t in TILES:
        lab = "triton_" + t.label()
        try:
            y = fp8_block_gemm(xq, sa, res[0].q, res[0].scale, sb_rows=128, m=m, tile=t)
            torch.cuda.synchronize()
        except Exception as exc:  # a tile this GPU cannot hold (shared memory, registers)
            cols[lab] = {"error": str(exc).splitlines()[0][:160]}
            continue
        err = rel(y, y_block[:m])
        us = None
        if err < 2e-3:
            us = timed(
                [
                    lambda i=i, t=t: fp8_block_gemm(
                        quant[i][0], quant[i][1], res[i].q, res[i].scale, sb_rows=128,
                        m=m, tile=t,
                    )
                    for i in range(copies)
                ],
                m,
            )  # fmt: skip
            if best is None or us < cols[best]["us"]:
                best = lab
        cols[lab] = {"err_vs_cublas": err, "us": us}
    # whole paths: quantize + GEMM
    tiles = {("triton_" + t.label()): t for t in TILES}
    if best is not None:
        tb = tiles[best]
        cols["path_triton"] = {
            "tile": best,
            "us": timed(
                [
                    lambda i=i: fp8_block_gemm(
                        *fp8p.quantize_activations(xs[i], "128x128"), res[i].q,
                        res[i].scale, sb_rows=128, m=m, tile=tb,
                    )
                    for i in range(copies)
                ],
                m,
            ),
        }  # fmt: skip
    cols["path_cublas"] = {
        "us": timed(
            [
                lambda i=i: fp8p.fp8_prefill_linear(
                    xs[i], q.packed, sf, q.global_scale, fmt="nvfp4", resident=res[i]
                )
                for i in range(copies)
            ],
            m,
        )
    }
    r["best_tile"] = best
    bf = cols["bf16"]["us"]
    line = " ".join(
        f"{c}={v['us']:.1f}({bf / v['us']:.2f}x)"
        for c, v in cols.items()
        if v.get("us")
        and (not c.startswith("triton_") or c == best)
        and not c.startswith("actq_hw_")
    )
    log(f"{model} {name} M={m}: {line} actq_equal={r['actq_equal']} [{time.time() - t0:.0f}s]")
    fails = {c: v for c, v in cols.items() if v.get("us") is None and c != "bf16"}
    if fails:
        log(f"  not timed: {fails}")
    return r


def markdown(meta: dict, rows: list[dict]) -> str:
    out = [f"# FP8 GEMM sweep on {meta['device']} ({meta['date']})", "",
           f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}. Median us per "
           "call (CUDA-graph replays, operands rotated past L2); x = speed-up over bf16.", "",
           "| shape | M | bf16 | cuBLAS block | cuBLAS row | cuBLAS tensor | Triton best | tile "
           "| actq int | actq hw | path Triton | path cuBLAS |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        c = r["cols"]
        bf = c["bf16"]["us"]

        def cell(key, c=c, bf=bf):
            v = c.get(key, {}).get("us")
            return f"{v:.1f} ({bf / v:.2f}x)" if v else "-"

        best = r["best_tile"]
        out.append(
            f"| {r['shape']} {r['N']}x{r['K']} | {r['M']} | {bf:.1f} | {cell('cublas_block')} | "
            f"{cell('cublas_row')} | {cell('cublas_tensor')} | {cell(best) if best else '-'} | "
            f"{best or '-'} | {cell('actq_int')} | {cell('actq_hw')} | {cell('path_triton')} | "
            f"{cell('path_cublas')} |"
        )
    out += ["", "## Every tile (us)", "", "| shape | M | " + " | ".join(t.label() for t in TILES)
            + " |", "|---|---|" + "---|" * len(TILES)]  # fmt: skip
    for r in rows:
        cells = []
        for t in TILES:
            v = r["cols"].get("triton_" + t.label(), {})
            cells.append(f"{v['us']:.1f}" if v.get("us") else ("err" if "error" in v else "-"))
        out.append(f"| {r['shape']} | {r['M']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="8b")
    ap.add_argument("--ms", default="256,1024,4096")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = ap.parse_args()
    import linear as L

    L.copy_bandwidth()  # clocks up
    meta = {
        "device": torch.cuda.get_device_name(),
        "date": dt.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "tiles": [t.label() for t in TILES],
    }
    rows: list[dict] = []
    ms = [int(v) for v in args.ms.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = meta["device"].lower().replace("nvidia ", "").replace(" ", "-")
    base = out / f"fp8-gemm-sweep-{slug}-{meta['date']}"
    for model in args.models.split(","):
        for name, n, k in SHAPES[model]:
            run_shape(model, name, n, k, ms, rows)
            base.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            base.with_suffix(".md").write_text(markdown(meta, rows))
    log(f"wrote {base}.md")


if __name__ == "__main__":
    main()
