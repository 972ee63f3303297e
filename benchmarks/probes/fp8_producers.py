#!/usr/bin/env python3
"""FP8 prefill with and without fused producers, per Llama shape, on the GPU.

Each linear of a decoder layer is timed together with the kernel that makes its input, as a
model runs them (resident FP8 copy, the 128x128 recipe, NVFP4 weights, bf16 activations):

- qkv and gate_up read an RMSNorm's output, down reads SiLU(gate) x up, o reads attention's
  output (no producer of ours: timed alone);
- ``bf16``: our Triton producer writing bf16 only, then bf16 cuBLAS on the dequantized weight;
  ``bf16_eager``: the same with the producer as HF's eager module computes it (several torch
  kernels), for reference;
- ``fp8``: the producer writing bf16, then the FP8 linear quantizing its own input (what runs
  without fused producers);
- ``fp8_fused``: the producer writing bf16 and the e4m3 codes, the linear taking the codes from
  the handoff inside a sharing scope (what ``load_model`` / ``quantize_model`` install for the
  Llama family).

Checks before timing: on the producer's output, the linear taking the codes from the handoff
bit-equal with the linear quantizing that output itself, and the handoff hit; the FP8 output
within the FP8 error of the float64 W4A16 result on 64 rows. The producer's 16-bit output can
differ by a rounding step between its two variants (with and without codes: the compiler may
add the squares in another order), so ``fp8`` and ``fp8 fused`` are not compared bit by bit.
Timing as benchmarks/linear.py (median of CUDA-graph replays, inputs and weights rotated past
L2). Writes fp8-producers-<gpu>-<date>.json / .md under --out.

    PYTHONPATH=$PWD python3 benchmarks/probes/fp8_producers.py [--models 8b] [--ms 256,1024,4096]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from fp8_prefill_report import SHAPES
from linear import rel_err as rel
from linear import time_rotated as timed

PRODUCER = {"qkv": "rmsnorm", "gate_up": "rmsnorm", "down": "silu_mul", "o": None}
ROTATE_BYTES = 256 << 20
PATHS = ("bf16_eager", "bf16", "fp8", "fp8_fused")
#: (rows per program, warps) of the SiLU x mul producer, timed at every M of down
SILU_SHAPES = [(8, 4), (16, 8), (32, 4), (32, 8), (64, 8)]


def log(*a: object) -> None:
    print(*a, flush=True)


def producers(kind: str | None, k: int, eps: float = 1e-5):
    """(eager, ours(quantize)) producer callables of one input tuple (ours offers its codes
    to the open sharing scope, as the HF integration's fused ops do)."""
    from quantdispatch.integrations.transformers import fp8_handoff
    from quantdispatch.kernels.native.fp8_producers import rmsnorm_fp8, silu_mul_fp8

    def offered(out):  # (y, codes) -> y, the codes offered
        fp8_handoff.offer(*out)
        return out[0]

    if kind is None:
        return (lambda inp: inp[0]), (lambda inp, quantize: inp[0])
    if kind == "rmsnorm":
        w = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)

        def eager(inp):
            h = inp[0].float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            return w * h.to(torch.bfloat16)

        return eager, lambda inp, quantize: offered(rmsnorm_fp8(inp[0], w, eps, quantize=quantize))

    def eager_silu(inp):
        return F.silu(inp[0]) * inp[1]

    return eager_silu, lambda inp, quantize: offered(
        silu_mul_fp8(inp[0], inp[1], quantize=quantize)
    )


def run_shape(model: str, name: str, n: int, k: int, ms: list[int]) -> list[dict]:
    from quantdispatch.backends.triton.fp8_compute import handoff_in_use
    from quantdispatch.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
    from quantdispatch.integrations.transformers import fp8_handoff
    from quantdispatch.kernels.native import fp8_prefill as fp8p

    g = torch.Generator(device="cuda").manual_seed(n + k)
    q = quantize_nvfp4(torch.randn(n, k, generator=g, device="cuda") * 0.02)
    sf = q.block_scale.view(torch.uint8)
    copies = max(2, min(8, math.ceil(ROTATE_BYTES / (n * k))))
    res = [
        fp8p.make_resident(q.packed, sf, q.global_scale, fmt="nvfp4", recipe="128x128")
        for _ in range(copies)
    ]
    wb = [dequantize_nvfp4(q, dtype=torch.bfloat16) for _ in range(copies)]
    w64 = wb[0].double()
    kind = PRODUCER[name]
    eager, ours = producers(kind, k)
    rows = []
    for m in ms:
        n_in = 2 if kind == "silu_mul" else 1
        inps = [
            tuple(torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16) * 2
                  for _ in range(n_in))
            for _ in range(copies)
        ]  # fmt: skip

        def fp8_linear(y, i):
            return fp8p.fp8_prefill_linear(
                y,
                q.packed,
                sf,
                q.global_scale,
                fmt="nvfp4",
                resident=res[i],
                handoff=handoff_in_use(),
            )

        def fused(i, inps=inps):
            with fp8_handoff.sharing():  # what a scoped HF decoder layer opens
                return fp8_linear(ours(inps[i], kind is not None), i)

        path = {
            "bf16_eager": lambda i, inps=inps: F.linear(eager(inps[i]), wb[i]),
            "bf16": lambda i, inps=inps: F.linear(ours(inps[i], False), wb[i]),
            "fp8": lambda i, inps=inps: fp8_linear(ours(inps[i], False), i),
            "fp8_fused": fused,
        }
        r = {"model": model, "shape": name, "N": n, "K": k, "M": m, "producer": kind, "us": {}}
        # the linear on the producer's output: codes from the handoff vs quantized itself
        fp8_handoff.clear()
        with fp8_handoff.sharing():
            x_fused = ours(inps[0], kind is not None)
            y_fused = fp8_linear(x_fused, 0)
        hits = fp8_handoff.counts()["hits"]
        fp8_handoff.clear()
        y_own = fp8_linear(x_fused.clone(), 0)
        r["fused_bit_equal"] = bool(torch.equal(y_own, y_fused))
        r["handoff_hit"] = hits == 1 if kind is not None else hits == 0
        y_fp8 = path["fp8"](0)
        x64 = ours(inps[0], False)[:64].double()
        ref = x64 @ w64.T
        r["err"] = {"fp8": rel(y_fp8[:64], ref), "bf16": rel(path["bf16"](0)[:64], ref)}
        ok = r["fused_bit_equal"] and r["handoff_hit"] and r["err"]["fp8"] < 0.06
        for p in PATHS:
            if p.startswith("fp8") and not ok:
                continue
            r["us"][p] = timed([lambda i=i, f=path[p]: f(i) for i in range(copies)], m)
        if kind == "silu_mul":  # program shapes of the SiLU x mul producer
            from quantdispatch.kernels.native.fp8_producers import silu_mul_fp8

            for rp, nw in SILU_SHAPES:
                r["us"][f"silu_fp8_r{rp}w{nw}"] = timed(
                    [lambda i=i, inps=inps, rp=rp, nw=nw: silu_mul_fp8(
                        *inps[i], rows_per_program=rp, num_warps=nw) for i in range(copies)],
                    m,
                )  # fmt: skip
        if kind is not None:
            r["us"]["producer_bf16"] = timed(
                [lambda i=i, inps=inps: ours(inps[i], False) for i in range(copies)], m
            )
            r["us"]["producer_fp8"] = timed(
                [lambda i=i, inps=inps: ours(inps[i], True) for i in range(copies)], m
            )
        us = r["us"]
        log(
            f"{model} {name} M={m}: " + " ".join(f"{p}={t:.1f}" for p, t in us.items())
            + (f" | fused {us['bf16'] / us['fp8_fused']:.2f}x bf16" if ok else f" | FAILED {r}")
        )  # fmt: skip
        rows.append(r)
    return rows


def render(report: dict) -> str:
    lines = [
        f"# FP8 prefill with fused producers on {report['device']} ({report['date'][:10]})",
        "",
        f"torch {report['torch']}. NVFP4 weights, resident FP8 copy (128x128), bf16 "
        "activations. Median us per producer + linear (CUDA-graph replays, rotated past L2); "
        "x = speed-up over `bf16` (our producer writing bf16, then bf16 cuBLAS). `fp8`: the "
        "linear quantizes its own input; `fp8 fused`: the producer writes the codes too.",
        "",
        "| shape | producer | M | bf16 eager | bf16 | fp8 | fp8 fused | producer bf16 / fp8 "
        "| err fp8 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        us = r["us"]
        b = us["bf16"]

        def cell(p, us=us, b=b):
            return f"{us[p]:.1f} ({b / us[p]:.2f}x)" if p in us else "failed"

        prod = f"{us['producer_bf16']:.1f} / {us['producer_fp8']:.1f}" if r["producer"] else ""
        lines.append(
            f"| {r['model']} {r['shape']} {r['N']}x{r['K']} | {r['producer'] or '-'} | {r['M']} "
            f"| {cell('bf16_eager')} | {b:.1f} | {cell('fp8')} | {cell('fp8_fused')} | {prod} "
            f"| {r['err']['fp8']:.2e} |"
        )
    lines += ["", "Per decoder layer (the four shapes summed):", "",
              "| model | M | bf16 | fp8 | fp8 fused |", "|---|---|---|---|---|"]  # fmt: skip
    by: dict[tuple[str, int], dict[str, float]] = {}
    for r in report["rows"]:
        t = by.setdefault((r["model"], r["M"]), {})
        for p in ("bf16", "fp8", "fp8_fused"):
            t[p] = t.get(p, 0.0) + r["us"].get(p, math.inf)
    for (model, m), t in sorted(by.items()):
        lines.append(
            f"| {model} | {m} | {t['bf16']:.1f} | {t['fp8']:.1f} ({t['bf16'] / t['fp8']:.2f}x) "
            f"| {t['fp8_fused']:.1f} ({t['bf16'] / t['fp8_fused']:.2f}x) |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="8b")
    ap.add_argument("--ms", default="256,1024,2048,4096,8192")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    rows = []
    for model in args.models.split(","):
        for name, n, k in SHAPES[model]:
            rows += run_shape(model, name, n, k, ms)
            torch.cuda.empty_cache()
    now = dt.datetime.now(dt.UTC)
    report = dict(device=torch.cuda.get_device_name(), date=now.isoformat(timespec="seconds"),
                  torch=torch.__version__, rows=rows)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"fp8-producers-h200-{now:%Y-%m-%d}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    stem.with_suffix(".md").write_text(render(report), encoding="utf-8")
    print(render(report))
    bad = [r for r in rows if not (r["fused_bit_equal"] and r["handoff_hit"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
