#!/usr/bin/env python3
"""Host time of one quantized linear call in eager mode, layer by layer down to the kernel.

In eager decode (transformers without compile) each layer call costs its host time, not its
kernel time: at M = 1 the kernels take a few microseconds. This times, per call, with the GPU
never the bottleneck (calls queue faster than they run only if the host is faster):

- ``QuantLinear``: the layer's forward (checks, the custom op, the backend, the launcher);
- ``custom op``: ``torch.ops.quantdispatch.linear`` with the layer's arguments;
- ``backend``: the triton backend's ``linear`` (dispatch by the regime table, the launcher);
- ``launcher``: the kernel file's launcher (``mma_linear``: config, grid, Triton's launch);
- ``triton floor``: a one-line Triton kernel's launch, the cost of any Triton call;
- ``F.linear``: bf16 cuBLAS on the dequantized weight, for comparison.

    PYTHONPATH=$PWD python3 benchmarks/host_overhead.py [--n 2048 --k 2048] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@triton.jit
def _touch(out_ptr):
    tl.store(out_ptr, 1.0)


def per_call_us(fn: Callable[[], object], calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls)
    return 1e6 * best


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--out", default=None, help="folder for host-overhead-<n>x<k>.json")
    args = p.parse_args(argv)
    from quantdispatch import QuantLinear, load_settings
    from quantdispatch.backends import get_backend
    from quantdispatch.kernels.mma_layout.gemv import mma_linear

    dev = torch.device("cuda")
    dense = torch.nn.Linear(args.k, args.n, bias=False, dtype=torch.bfloat16, device=dev)
    layer = QuantLinear.from_float(dense, "nvfp4", settings=load_settings({}))
    x = torch.randn(args.m, args.k, dtype=torch.bfloat16, device=dev)
    tensors = layer._tensors()
    op_args = (x, tensors, layer.bias, layer.backend, layer.format, layer._meta_args,
               layer.out_features, layer.decision.pdl)  # fmt: skip
    backend = get_backend(layer.backend)
    out = torch.empty(1, device=dev)
    w = dense.weight
    rows = {
        "QuantLinear": per_call_us(lambda: layer(x)),
        "custom op": per_call_us(lambda: torch.ops.quantdispatch.linear(*op_args)),
        "backend": per_call_us(
            lambda: backend.linear(x, tensors, None, layer.format, layer._layout, layer._meta)
        ),
        "triton floor": per_call_us(lambda: _touch[(1,)](out)),
        "F.linear": per_call_us(lambda: F.linear(x, w)),
    }
    if layer._layout.value == "mma16x64":
        rows["launcher"] = per_call_us(lambda: mma_linear(x, *tensors[:3]))
    report = {"n": args.n, "k": args.k, "m": args.m, "layout": layer._layout.value}
    report.update({k: round(v, 1) for k, v in rows.items()})
    print(json.dumps(report))
    if args.out:
        path = Path(args.out) / f"host-overhead-{args.n}x{args.k}.json"
        path.write_text(json.dumps(report, indent=1), encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
