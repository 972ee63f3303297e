#!/usr/bin/env python3
"""Probe: can cuBLAS's block-scaled FP8 GEMM fill the H200 at small M?

At M = 256 an 8B o / down GEMM has 64 output tiles of 128 x 128 for 132 SMs. This times, on
the same e4m3 operands (NVFP4 weight re-encoded, activations quantized 1x128):

- ``bf16``: cuBLAS on the dequantized weight;
- ``block``: one ``torch._scaled_mm`` (128x128 weight blocks);
- ``splitK<s>``: K cut into s parts, each its own block-scaled GEMM into an fp32 partial, the
  parts on s streams (concurrent), then one sum into bf16; ``splitK<s>seq``: same, one stream;
- ``swap``: the transposed product W x^T (weight as the 1x128 left operand, activations as the
  1x128 right one), written [N, M] and transposed back.

Each output is checked against the one-GEMM block output before it is timed (relative error
< 1e-3: only summation order and one bf16 rounding differ). Timing as benchmarks/linear.py.

    PYTHONPATH=$PWD python3 benchmarks/probes/fp8_splitk_probe.py --ms 128,256,512,1024 --out DIR
"""

from __future__ import annotations

import argparse
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

ROTATE_BYTES = 256 << 20


def split_operands(xq, sa, w, parts: int):
    """Contiguous K-parts of the activations, their scales, the weight and its 128x128 scales."""
    k = xq.shape[1]
    step = k // parts
    out = []
    for p in range(parts):
        a, b = p * step, (p + 1) * step
        kb0, kb1 = a // 128, b // 128
        xa = xq[:, a:b].contiguous()
        s = sa[:, kb0:kb1].t().contiguous().t()
        wq = w.q[:, a:b].contiguous()
        ws = w.scale[:, kb0:kb1].contiguous()
        out.append((xa, s, wq, ws))
    return out


def one_m(model, name, n, k, m, g, res, res1, wb, copies) -> dict:
    from quantdispatch.kernels.native import fp8_prefill as fp8p

    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    xs = [x.clone() for _ in range(copies)]
    quant = [fp8p.quantize_activations(xx, "128x128") for xx in xs]
    r = {"model": model, "shape": name, "N": n, "K": k, "M": m, "us": {}, "err": {}}

    def block(i):
        a, s = quant[i]
        return torch._scaled_mm(a, res[i].q.t(), s, res[i].scale.t(),
                                out_dtype=torch.bfloat16)  # fmt: skip

    def swap(i, transpose=True):
        a, s = quant[i]
        y = torch._scaled_mm(res1[i].q, a.t(), res1[i].scale, s.t(),
                             out_dtype=torch.bfloat16)  # fmt: skip
        return y.t().contiguous() if transpose else y.t()

    cand = {"bf16": lambda i: F.linear(xs[i], wb[i]), "block": block,
            "swap": swap, "swap_view": lambda i: swap(i, False)}  # fmt: skip
    streams = [torch.cuda.Stream() for _ in range(4)]
    for parts in (2, 3, 4):
        if k % (parts * 128) or (k // parts // 128) % 4:
            continue
        ops = [split_operands(*quant[i], res[i], parts) for i in range(copies)]

        def splitk(i, ops=ops, parts=parts, concurrent=True):
            cur = torch.cuda.current_stream()
            outs = []
            for p, (xa, s, wq, ws) in enumerate(ops[i]):
                st = streams[p] if concurrent else cur
                st.wait_stream(cur)
                with torch.cuda.stream(st):
                    outs.append(torch._scaled_mm(xa, wq.t(), s, ws.t(),
                                                 out_dtype=torch.float32))  # fmt: skip
            for p in range(parts):
                if concurrent:
                    cur.wait_stream(streams[p])
            return torch.stack(outs).sum(0).to(torch.bfloat16)

        cand[f"splitK{parts}"] = splitk
        cand[f"splitK{parts}seq"] = lambda i, f=splitk: f(i, concurrent=False)
    ref = block(0)
    for c, f in cand.items():
        try:
            y = f(0)
            torch.cuda.synchronize()
        except RuntimeError as exc:
            r["err"][c] = str(exc).splitlines()[0][:160]
            continue
        e = rel(y[:m].float(), ref[:m].float()) if c != "bf16" else None
        r["err"][c] = e
        if e is None or e < 1e-3:
            r["us"][c] = timed([lambda i=i, f=f: f(i) for i in range(copies)], m)
    b = r["us"]["bf16"]
    print(
        f"{name} M={m}: " + " ".join(f"{c}={t:.1f}({b / t:.2f}x)" for c, t in r["us"].items()),
        flush=True,
    )
    return r


def main() -> int:
    from quantdispatch.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
    from quantdispatch.kernels.native import fp8_prefill as fp8p

    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="128,256,512,1024")
    ap.add_argument("--models", default="8b")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    rows = []
    for model in args.models.split(","):
        for name, n, k in SHAPES[model]:
            g = torch.Generator(device="cuda").manual_seed(n + k)
            q = quantize_nvfp4(torch.randn(n, k, generator=g, device="cuda") * 0.02)
            sf = q.block_scale.view(torch.uint8)
            copies = max(2, min(8, math.ceil(ROTATE_BYTES / (n * k))))
            res = [fp8p.make_resident(q.packed, sf, q.global_scale, fmt="nvfp4", recipe="128x128")
                   for _ in range(copies)]  # fmt: skip
            res1 = [fp8p.make_resident(q.packed, sf, q.global_scale, fmt="nvfp4", recipe="1x128")
                    for _ in range(copies)]  # fmt: skip
            wb = [dequantize_nvfp4(q, dtype=torch.bfloat16) for _ in range(copies)]
            for m in ms:
                rows.append(one_m(model, name, n, k, m, g, res, res1, wb, copies))
            del res, res1, wb
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8-splitk-probe.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
