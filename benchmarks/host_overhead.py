#!/usr/bin/env python3
"""Host time of one eager layer call, against ``F.linear``: what an eager decode step pays.

In eager mode (transformers without compile or graphs) a layer call costs its host time
whenever that exceeds its kernel time: at M = 1 the kernels take a few microseconds. Per call,
on Llama-3-8B linear shapes and a Qwen3-30B-A3B MoE layer, at M = 1, 16, 256, 4096:

- ``F.linear``: bf16 cuBLAS on a bf16 weight of the same shape (the target: 1.5x of it);
- ``QuantLinear``: the layer's eager forward (the bound call path, quantdispatch.backends.bound);
- ``op``: ``torch.ops.quantdispatch.linear`` with the layer's arguments (what compile traces);
- ``QuantMoE``: the MoE layer's eager forward with precomputed top-k ids and weights.

Host time is measured without waiting for the GPU: ``calls`` launches are timed on the host
(few enough that the launch queue never fills and blocks), then the GPU is synchronized. The
first calls of each size run first (compiles, plans). Every layer is checked against float64
on its first call, so a fast wrong path cannot pass.

    PYTHONPATH=$PWD python3 benchmarks/host_overhead.py [--out DIR] [--calls 40]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (1, 16, 256, 4096)
#: Qwen3-30B-A3B: experts, top-k, hidden, intermediate.
MOE = (128, 8, 2048, 768)


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Median over 5 rounds of host microseconds per call (no GPU wait inside a round)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    rounds.sort()
    return 1e6 * rounds[len(rounds) // 2]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def linear_rows(calls: int) -> list[dict[str, object]]:
    rows = []
    for name, (n, k) in SHAPES.items():
        rows += _shape_rows(name, n, k, calls)
    return rows


def _shape_rows(name: str, n: int, k: int, calls: int) -> list[dict[str, object]]:
    from quantdispatch import QuantLinear, load_settings
    from quantdispatch.formats import dequantize_nvfp4, quantize_nvfp4

    dev = torch.device("cuda")
    dense = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=dev)
    layer = QuantLinear.from_float(dense, "nvfp4", settings=load_settings({}))
    # the weight from_float quantizes, dequantized exactly
    w64 = dequantize_nvfp4(quantize_nvfp4(dense.weight.detach()), dtype=torch.float64)
    op_args = (layer._tensors(), layer.bias, layer.backend, layer.format, layer._meta_args,
               layer.out_features, layer.decision.pdl)  # fmt: skip
    rows = []
    for m in MS:
        x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
        err = _rel_err(layer(x), x.double() @ w64.T)
        if not err < 1e-2:
            raise SystemExit(f"{name} M={m}: QuantLinear rel. error {err:.3g} vs float64")
        row: dict[str, object] = {
            "layer": name, "n": n, "k": k, "m": m, "family": layer.bound().family_for(m),
            "F.linear": host_us(lambda x=x: F.linear(x, dense.weight), calls),
            "QuantLinear": host_us(lambda x=x: layer(x), calls),
            "op": host_us(lambda x=x: torch.ops.quantdispatch.linear(x, *op_args), calls),
            "rel_err": err,
        }  # fmt: skip
        row["ratio"] = row["QuantLinear"] / row["F.linear"]  # type: ignore[operator]
        rows.append(row)
        _show(row)
    return rows


def _show(row: dict[str, object]) -> None:
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))


def moe_rows(calls: int) -> list[dict[str, object]]:
    from quantdispatch import load_settings
    from quantdispatch.formats import quantize_nvfp4
    from quantdispatch.layers import QuantMoE

    e, top_k, hidden, inter = MOE
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def experts(n: int, k: int) -> list[object]:
        return [quantize_nvfp4(torch.randn(n, k, device=dev, generator=g) * 0.02)
                for _ in range(e)]  # fmt: skip

    moe = QuantMoE(  # as the HF integration builds it: no host check of the ids (a sync)
        experts(inter, hidden), experts(inter, hidden), experts(hidden, inter), top_k=top_k,
        settings=load_settings({}), device=dev, validate_ids=False,
    )  # fmt: skip
    rows = []
    for m in MS:
        x = torch.randn(m, hidden, dtype=torch.bfloat16, device=dev)
        logits = torch.randn(m, e, device=dev)
        weights, ids = torch.topk(torch.softmax(logits, -1), top_k)
        weights = weights / weights.sum(-1, keepdim=True)
        ids = ids.to(torch.int32)
        row = {
            "layer": "qwen3-30b-a3b moe", "m": m,
            "QuantMoE": host_us(lambda x=x, i=ids, w=weights: moe(x, topk_ids=i, topk_weights=w),
                                calls),
        }  # fmt: skip
        rows.append(row)
        _show(row)
    return rows


def profile_calls(calls: int = 300) -> None:
    """Where a call's host time goes: cProfile over ``calls`` eager calls of the 8B qkv layer at
    M = 256 (the wgmma GEMM) and 4096 (dequantize + cuBLAS) and of the 30B-A3B MoE at M = 1."""
    from quantdispatch import QuantLinear, load_settings
    from quantdispatch.formats import quantize_nvfp4
    from quantdispatch.layers import QuantMoE

    dev = torch.device("cuda")
    dense = torch.nn.Linear(4096, 6144, bias=False, dtype=torch.bfloat16, device=dev)
    layer = QuantLinear.from_float(dense, "nvfp4", settings=load_settings({}))
    e, top_k, hidden, inter = MOE
    g = torch.Generator(device=dev).manual_seed(0)

    def experts(n: int, k: int) -> list[object]:
        return [quantize_nvfp4(torch.randn(n, k, device=dev, generator=g) * 0.02)
                for _ in range(e)]  # fmt: skip

    moe = QuantMoE(experts(inter, hidden), experts(inter, hidden), experts(hidden, inter),
                   top_k=top_k, settings=load_settings({}), device=dev,
                   validate_ids=False)  # fmt: skip
    x1 = torch.randn(1, hidden, dtype=torch.bfloat16, device=dev)
    weights, ids = torch.topk(torch.softmax(torch.randn(1, e, device=dev), -1), top_k)
    ids = ids.to(torch.int32)
    cases = {
        "QuantLinear M=256": (layer, torch.randn(256, 4096, dtype=torch.bfloat16, device=dev)),
        "QuantLinear M=4096": (layer, torch.randn(4096, 4096, dtype=torch.bfloat16, device=dev)),
    }
    for label, (mod, x) in cases.items():
        _profile(label, lambda mod=mod, x=x: mod(x), calls)
    _profile("QuantMoE M=1", lambda: moe(x1, topk_ids=ids, topk_weights=weights), calls)


def _profile(label: str, fn: Callable[[], object], calls: int) -> None:
    import cProfile
    import pstats

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    print(f"== {label}: {calls} calls")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=40, help="calls per timed round")
    p.add_argument("--out", default=None, help="folder for host-overhead-<gpu>.json")
    p.add_argument("--skip-moe", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="print cProfile's top functions for QuantLinear at M=256 and QuantMoE "
                        "at M=1 instead of the table")  # fmt: skip
    args = p.parse_args(argv)
    if args.profile:
        profile_calls()
        return {}
    import triton

    report: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "what": "host microseconds per eager call (median of 5 rounds), no GPU wait in a round",
        "linear": linear_rows(args.calls),
        "moe": [] if args.skip_moe else moe_rows(args.calls),
    }
    if args.out:
        gpu = torch.cuda.get_device_name().lower().replace(" ", "-")
        path = Path(args.out) / f"host-overhead-{gpu}.json"
        path.write_text(json.dumps(report, indent=1), encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
