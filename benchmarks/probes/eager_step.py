#!/usr/bin/env python3
"""Where an eager decode step's time goes: Llama-3-8B-shaped layers (``--layers``, random
weights), the one-token step on a StaticCache (``capture_decode(capture=False)``) for bf16,
bf16 with fused ops and NVFP4 with fused ops, at each batch: ms per step (median of rounds),
CUDA kernels launched per step, and with ``--profile`` the Python functions with the most
own time over a few steps. ``--prefill N`` does the same for one forward over N tokens and
lists the CUDA kernels with the most GPU time (is a prefill host- or GPU-bound, and where).

    PYTHONPATH=$PWD python3 benchmarks/probes/eager_step.py --layers 8 --batches 1,16 --profile
    PYTHONPATH=$PWD python3 benchmarks/probes/eager_step.py --layers 8 --batches "" --prefill 512
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from whole_model import PROMPT, build


def step_ms(dec, ids, steps: int, rounds: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(rounds + 1):
        dec.prefill(ids)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            dec.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / steps)
    return 1e3 * statistics.median(times[1:])


def kernels_per_step(dec, ids) -> int:  # type: ignore[no-untyped-def]
    from torch.profiler import ProfilerActivity, profile

    dec.prefill(ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            dec.step()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA") // 4


def prefill_report(model, tokens: int, rounds: int) -> dict:  # type: ignore[no-untyped-def]
    """Wall ms of one forward over ``tokens`` tokens (median), GPU busy ms from the profiler,
    and the kernels with the most GPU time."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(1, 1000, (1, tokens), device="cuda")

    def fwd() -> None:
        with torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1)

    fwd()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fwd()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwd()
        torch.cuda.synchronize()
    kern = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in kern) / 1e3
    top = sorted(kern, key=lambda e: -e.self_device_time_total)[:12]
    return dict(wall_ms=round(statistics.median(times), 2), gpu_ms=round(total, 2),
                top=[(e.key[:70], e.count, round(e.self_device_time_total / 1e3, 2))
                     for e in top])  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--prefill", default="", help="token counts of prefill reports")
    a = p.parse_args()
    from quantdispatch.integrations.transformers import (
        capture_decode,
        install_fused_ops,
        quantize_model,
        remove_fused_ops,
    )

    model = build("llama-3-8b", a.layers, torch.device("cuda"))
    for variant in ("bf16", "bf16-fused", "quant"):
        if variant == "quant":
            quantize_model(model, "nvfp4", fused_ops=False)
        if variant == "bf16":
            remove_fused_ops(model)
        else:
            install_fused_ops(model)
        for tokens in (int(t) for t in a.prefill.split(",") if t):
            row = dict(variant=variant, tokens=tokens, layers=a.layers,
                       **prefill_report(model, tokens, a.rounds))  # fmt: skip
            print(json.dumps(row), flush=True)
        for batch in (int(b) for b in a.batches.split(",") if b):
            ids = torch.randint(1, 1000, (batch, PROMPT), device="cuda")
            dec = capture_decode(model, batch, PROMPT + a.steps + 8, capture=False)
            ms = step_ms(dec, ids, a.steps, a.rounds)
            row = dict(variant=variant, batch=batch, layers=a.layers, step_ms=round(ms, 3),
                       kernels=kernels_per_step(dec, ids))  # fmt: skip
            print(json.dumps(row), flush=True)
            if a.profile:
                dec.prefill(ids)
                torch.cuda.synchronize()
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(8):
                    dec.step()
                torch.cuda.synchronize()
                prof.disable()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
                print(buf.getvalue()[-4500:], flush=True)


if __name__ == "__main__":
    main()
