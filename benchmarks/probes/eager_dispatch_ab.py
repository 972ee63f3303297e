#!/usr/bin/env python3
"""Eager decode with the layers' direct backend call vs through the custom op, in one process.

Eager decode times vary with the host from run to run far more than the op's dispatch cost, so
the two paths are compared here in alternation on one model (Llama-3.2-1B shapes, NVFP4,
``quantize_model``), with the bf16 model in the same process for scale: ms per decode step =
(t(1 + S tokens) - t(1 token)) / S of eager ``generate`` with a static cache, medians of
``--reps`` alternating repeats.

    PYTHONPATH=$PWD python3 benchmarks/probes/eager_dispatch_ab.py [--batches 1,16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import model_decode as md  # benchmarks/model_decode.py: the model and settings


def step_ms(model: Any, ids: torch.Tensor, steps: int) -> float:
    def run(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids, max_new_tokens=n, do_sample=False, cache_implementation="static",
                disable_compile=True,
            )  # fmt: skip
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    return 1e3 * (run(1 + steps) - run(1)) / steps


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from quantdispatch.integrations.transformers import quantize_model
    from quantdispatch.layers import linear as layer_module

    margs = md.parse_args(["--config", "llama-3.2-1b"])
    dev = torch.device("cuda")
    bf16 = md.build_model(margs, dev)
    q = quantize_model(md.build_model(margs, dev), "nvfp4")
    direct = layer_module.direct_call_ok
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "rows": []}
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, bf16.config.vocab_size, (1, 128), generator=g)
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = prompt.repeat(batch, 1).to(dev)
        times: dict[str, list[float]] = {"bf16": [], "nvfp4 direct": [], "nvfp4 op": []}
        for model in (bf16, q):
            step_ms(model, ids, 4)  # warm-up: kernels compile, caches fill
        for _ in range(args.reps):
            times["bf16"].append(step_ms(bf16, ids, args.steps))
            layer_module.direct_call_ok = direct
            times["nvfp4 direct"].append(step_ms(q, ids, args.steps))
            layer_module.direct_call_ok = lambda x: False
            times["nvfp4 op"].append(step_ms(q, ids, args.steps))
            layer_module.direct_call_ok = direct
        row = {"batch": batch, **{k: round(statistics.median(v), 2) for k, v in times.items()}}
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out, "eager-dispatch-ab.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
