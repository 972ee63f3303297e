#!/usr/bin/env python3
"""Probe: vLLM's CUTLASS block-scaled FP8 GEMM beside cuBLAS's, on FP8 prefill's operands.

vLLM's compiled extension (``torch.ops._C.cutlass_scaled_mm``, the SM 9.0 "blockwise" kernels:
1x128 activation blocks, 128x128 weight blocks) takes the same operands as
``torch._scaled_mm``'s 128x128 recipe: e4m3 activations [M, K] row-major with fp32 scales
[M, K/128] M-major, the weight's e4m3 [N, K] passed transposed (column-major [K, N]) with its
scales [N/128, K/128] passed transposed. Per shape and M this times bf16 cuBLAS, cuBLAS's
block-scaled GEMM and vLLM's, after checking vLLM's output against cuBLAS's (same operands:
only the summation order differs). Timing as benchmarks/linear.py.

The library: ``--vllm-lib`` (e.g. /tmp/vllm/_C_stable_libtorch.abi3.so, decompressed from
.peer/vllm by ../shared/tools/peer-vllm-marlin.sh's recipe), else an installed vLLM.

    PYTHONPATH=$PWD python3 benchmarks/probes/fp8_cutlass_probe.py --vllm-lib PATH --out DIR
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
from linear import time_rotated

ROTATE_BYTES = 256 << 20


def load(path: str | None) -> None:
    if path:
        torch.ops.load_library(path)
    else:
        import vllm._C  # noqa: F401  (registers torch.ops._C)


def main() -> int:
    from quantdispatch.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
    from quantdispatch.kernels.native import fp8_prefill as fp8p

    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-lib")
    ap.add_argument("--models", default="8b,70b")
    ap.add_argument("--ms", default="64,128,256,512,1024,2048,4096,8192")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    load(args.vllm_lib)
    op = torch.ops._C.cutlass_scaled_mm
    cap = torch.cuda.get_device_capability()
    supports = torch.ops._C.cutlass_scaled_mm_supports_block_fp8(cap[0] * 10 + cap[1])
    print(f"cutlass_scaled_mm_supports_block_fp8: {supports}", flush=True)
    rows = []
    for model in args.models.split(","):
        for name, n, k in SHAPES[model]:
            g = torch.Generator(device="cuda").manual_seed(n + k)
            q = quantize_nvfp4(torch.randn(n, k, generator=g, device="cuda") * 0.02)
            sf = q.block_scale.view(torch.uint8)
            copies = max(2, min(8, math.ceil(ROTATE_BYTES / (n * k))))
            res = [fp8p.make_resident(q.packed, sf, q.global_scale, fmt="nvfp4", recipe="128x128")
                   for _ in range(copies)]  # fmt: skip
            wb = [dequantize_nvfp4(q, dtype=torch.bfloat16) for _ in range(copies)]
            for m in [int(v) for v in args.ms.split(",")]:
                xs = [torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
                      for _ in range(copies)]  # fmt: skip
                quant = [fp8p.quantize_activations(x, "128x128") for x in xs]

                def cublas(i, quant=quant, res=res):
                    a, s = quant[i]
                    return torch._scaled_mm(a, res[i].q.t(), s, res[i].scale.t(),
                                            out_dtype=torch.bfloat16)  # fmt: skip

                def cutlass(i, quant=quant, res=res, n=n):
                    a, s = quant[i]
                    out = torch.empty((a.shape[0], n), dtype=torch.bfloat16, device="cuda")
                    op(out, a, res[i].q.t(), s, res[i].scale.t(), None)
                    return out

                r = {"model": model, "shape": name, "N": n, "K": k, "M": m, "us": {}}
                try:
                    r["err_vs_cublas"] = rel(cutlass(0)[:m].float(), cublas(0)[:m].float())
                except RuntimeError as exc:
                    r["error"] = str(exc).splitlines()[0][:200]
                cand = {"bf16": lambda i, xs=xs, wb=wb: F.linear(xs[i], wb[i]), "cublas": cublas}
                if r.get("err_vs_cublas", 1.0) < 1e-3:
                    cand["cutlass"] = cutlass
                for c, f in cand.items():
                    r["us"][c] = time_rotated([lambda i=i, f=f: f(i) for i in range(copies)], m)
                b = r["us"]["bf16"]
                print(f"{model} {name} M={m}: " + " ".join(
                    f"{c}={t:.1f}({b / t:.2f}x)" for c, t in r["us"].items())
                    + (f" ERROR {r['error']}" if "error" in r else ""), flush=True)  # fmt: skip
                rows.append(r)
            del res, wb
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8-cutlass-probe.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
