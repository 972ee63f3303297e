#!/usr/bin/env python3
"""Does dequantizing the next layer's weight on a side stream hide the large-M dequantization?

Issue #40: from M ~ 1024 the triton backend dequantizes an NVFP4 weight to bf16 (one pass over
it) and calls cuBLAS; the pass adds 25-35% to the GEMM. This probe runs a chain of ``--layers``
linears of one shape (distinct random weights, each prepared as the triton backend prepares
it) at each M, three ways:

* ``seq``: what a layer runs today, one after the other: dequantize (the backend's own row
  dequantizer, the whole weight) then ``torch.mm``;
* ``overlap``: the same kernels with layer i+1's weight dequantized on a side stream into the
  second of two workspaces while layer i's GEMM runs on the main stream (events order them: a
  workspace is rewritten only after the GEMM that read it);
* ``bf16``: ``torch.mm`` on weights already dequantized (what a bf16 model pays: the parity
  target).

Each way's outputs are checked first: ``overlap`` must equal ``seq`` bit for bit (same
kernels, same inputs), and ``seq`` must be within bf16 rounding (1e-2 relative) of x @ W.T in
float64 on the dequantized checkpoint weight. Then each way is
timed as a whole chain (median of ``--reps`` after a warm-up, device synchronized at both ends)
and reported per layer with the ratios bf16 / way (1.0 = parity).

    PYTHONPATH=$PWD python3 benchmarks/probes/dequant_overlap.py [--ms 1024,4096] [--out DIR]
    PYTHONPATH=$PWD python3 benchmarks/probes/dequant_overlap.py --smoke   # CPU interpreter
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

#: Llama-3-8B's linears (N, K): qkv, o, gate_up, down.
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _dequantizer(n: int, k: int, device: torch.device, seed: int):  # type: ignore[no-untyped-def]
    """(rows(a, b, out), the dequantized bf16 weight, the float64 reference weight) of a random
    NVFP4 weight prepared as the triton backend prepares it on ``device``."""
    from quantdispatch.backends.base import as_op_tensors
    from quantdispatch.backends.prepared import Layout
    from quantdispatch.backends.triton import TritonBackend
    from quantdispatch.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
    from quantdispatch.request import Request

    g = torch.Generator().manual_seed(seed)
    weight = quantize_nvfp4(torch.randn(n, k, generator=g).to(device) * 0.02)
    request = Request.make("nvfp4", "linear", torch.bfloat16, n=n, k=k)
    prepared = TritonBackend().prepare(weight, request)
    t = as_op_tensors(list(prepared.tensors))  # the bound path's form: float8 as uint8 views
    if prepared.layout is Layout.MMA16X64:
        from quantdispatch.kernels.mma_layout.dequant import MmaDequantRows

        rows = MmaDequantRows(t[0], t[1], t[2])
    else:
        from quantdispatch.kernels.checkpoint_layout.dequant import Fp4DequantRows

        rows = Fp4DequantRows(t[0], t[1], t[2], scale_format="e4m3")
    w16 = torch.empty(n, k, dtype=torch.bfloat16, device=device)
    rows(0, n, w16)
    return rows, w16, dequantize_nvfp4(weight, dtype=torch.float64)


def run_seq(x, deqs, n: int, k: int):  # type: ignore[no-untyped-def]
    outs = []
    for rows in deqs:
        ws = torch.empty(n, k, dtype=x.dtype, device=x.device)
        rows(0, n, ws)
        outs.append(torch.mm(x, ws.t()))
    return outs


def run_overlap(x, deqs, n: int, k: int, side):  # type: ignore[no-untyped-def]
    """Layer i+1 dequantized on ``side`` (None: the CPU, no streams) while layer i multiplies."""
    cuda = side is not None
    main = torch.cuda.current_stream() if cuda else None
    on_side = (lambda: torch.cuda.stream(side)) if cuda else contextlib.nullcontext
    ws = [torch.empty(n, k, dtype=x.dtype, device=x.device) for _ in range(2)]
    ready = [torch.cuda.Event() for _ in deqs] if cuda else []
    done = [torch.cuda.Event() for _ in deqs] if cuda else []
    if cuda:
        side.wait_stream(main)
    with on_side():
        deqs[0](0, n, ws[0])
        if cuda:
            ready[0].record(side)
    outs = []
    for i in range(len(deqs)):
        if i + 1 < len(deqs):
            with on_side():
                if cuda and i >= 1:
                    side.wait_event(done[i - 1])  # the workspace layer i - 1 read is free
                deqs[i + 1](0, n, ws[(i + 1) % 2])
                if cuda:
                    ready[i + 1].record(side)
        if cuda:
            main.wait_event(ready[i])
        outs.append(torch.mm(x, ws[i % 2].t()))
        if cuda:
            done[i].record(main)
    if cuda:
        main.wait_stream(side)
    return outs


def run_bf16(x, w16s):  # type: ignore[no-untyped-def]
    return [torch.mm(x, w.t()) for w in w16s]


def _time(fn, reps: int, cuda: bool) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def measure(name: str, n: int, k: int, ms: list[int], layers: int, reps: int, device):  # type: ignore[no-untyped-def]
    cuda = device.type == "cuda"
    made = [_dequantizer(n, k, device, seed) for seed in range(layers)]
    deqs, w16s, w64s = ([t[i] for t in made] for i in range(3))
    side = torch.cuda.Stream(device) if cuda else None
    rows = []
    for m in ms:
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 0.5).to(device)
        x = x.to(torch.bfloat16)
        seq, ovl = run_seq(x, deqs, n, k), run_overlap(x, deqs, n, k, side)
        same = all(torch.equal(a, b) for a, b in zip(seq, ovl, strict=True))
        x64 = x.double()
        err = max(float((a.double() - x64 @ w.T).norm() / (x64 @ w.T).norm().clamp(min=1e-30))
                  for a, w in zip(seq, w64s, strict=True))  # fmt: skip
        row = dict(shape=name, n=n, k=k, m=m, layers=layers, overlap_equals_seq=same,
                   seq_rel_err_vs_float64=err)  # fmt: skip
        if same and err < 1e-2:
            t = {way: _time(fn, reps, cuda) / layers for way, fn in (
                ("seq", lambda x=x: run_seq(x, deqs, n, k)),
                ("overlap", lambda x=x: run_overlap(x, deqs, n, k, side)),
                ("bf16", lambda x=x: run_bf16(x, w16s)))}  # fmt: skip
            row.update({f"{w}_us": round(v, 1) for w, v in t.items()})
            row.update({f"bf16/{w}": round(t["bf16"] / t[w], 3) for w in ("seq", "overlap")})
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ms", default="1024,2048,4096")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes in Triton's CPU interpreter")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.smoke:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
        shapes, ms, device, reps = {"tiny": (128, 256)}, [3], torch.device("cpu"), 1
    else:
        shapes = {s: SHAPES[s] for s in a.shapes.split(",")}
        ms, device, reps = [int(m) for m in a.ms.split(",")], torch.device("cuda"), a.reps
    rows = []
    for name, (n, k) in shapes.items():
        rows += measure(name, n, k, ms, a.layers if not a.smoke else 3, reps, device)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "dequant-overlap.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
