#!/usr/bin/env python3
"""Does dequantizing the next layer's weight on a side stream hide the large-M dequantization?

Issue #40: from M ~ 1024 the triton backend dequantizes an NVFP4 weight to bf16 (one pass over
it) and calls cuBLAS; the pass adds 25-35% to the GEMM. This probe runs a chain of ``--layers``
linears of one shape (distinct random weights, each prepared as the triton backend prepares
it) at each M, several ways:

* ``seq``: what a layer runs today, one after the other: dequantize (the backend's own row
  dequantizer, the whole weight) then ``torch.mm``;
* ``seq_out``: the same with the GEMM writing through ``out=`` into a tensor allocated first;
* ``overlap``: the same kernels with layer i+1's weight dequantized on a side stream into the
  second of two workspaces while layer i's GEMM runs on the main stream (events order them: a
  workspace is rewritten only after the GEMM that read it);
* ``overlap_hi``: the same with the side stream at the highest stream priority, so its blocks
  are scheduled before the GEMM's pending ones;
* ``slabs``: no cross-layer state: each layer's weight in ``--slabs`` row slabs (multiples of
  128 rows), slab j + 1 dequantized on the (high-priority) side stream while slab j multiplies;
* ``slab<E>M``: what a layer runs today (``kernels.common.slabs.DequantGemm``) with a workspace
  of E Mi elements (``--slab-mi``; 32 is the shipped size): smaller slabs stay in L2 between
  their dequantization and their GEMM, but each GEMM is narrower;
* ``deq``: the dequantize passes alone (what ``seq`` adds to ``bf16`` when nothing overlaps);
* ``bf16``: ``torch.mm`` on weights already dequantized (what a bf16 model pays: the parity
  target).

Each way's outputs are checked first: every way must be within bf16 rounding (1e-2 relative)
of x @ W.T in float64 on the dequantized checkpoint weight, and ``seq_out``, ``overlap`` and
``overlap_hi`` must equal ``seq`` bit for bit (same kernels on the same inputs: anything else is
a race); the slab ways report whether they do (a narrower GEMM may run another cuBLAS kernel).
Then the ways are timed as whole chains (median of ``--reps`` rounds after a warm-up, each round
running every way once, the device synchronized around each) and reported per layer with the
ratios bf16 / way (1.0 = parity).

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


def run_seq(x, deqs, n: int, k: int, into: bool = False):  # type: ignore[no-untyped-def]
    """``into``: the GEMM writes through ``out=`` (as DequantGemm does), else returns."""
    outs = []
    for rows in deqs:
        ws = torch.empty(n, k, dtype=x.dtype, device=x.device)
        if into:
            out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
            rows(0, n, ws)
            outs.append(torch.mm(x, ws.t(), out=out))
            continue
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


def _slab_bounds(n: int, slabs: int) -> list[tuple[int, int]]:
    rows = max(128, -(-n // slabs) // 128 * 128)
    return [(a, min(n, a + rows)) for a in range(0, n, rows)]


def run_slabs(x, deqs, n: int, k: int, side, slabs: int):  # type: ignore[no-untyped-def]
    """Each layer alone: slab j + 1 dequantized on ``side`` while slab j multiplies."""
    cuda = side is not None
    main = torch.cuda.current_stream() if cuda else None
    on_side = (lambda: torch.cuda.stream(side)) if cuda else contextlib.nullcontext
    bounds = _slab_bounds(n, slabs)
    rows = bounds[0][1] - bounds[0][0]
    ws = [torch.empty(rows * k, dtype=x.dtype, device=x.device) for _ in range(2)]

    def fill(deq, j: int, ready, done) -> None:  # type: ignore[no-untyped-def]
        a, b = bounds[j]
        with on_side():
            if cuda and j >= 2:
                side.wait_event(done[j - 2])  # the GEMM that read this workspace is done
            deq(a, b, ws[j % 2][: (b - a) * k].view(b - a, k))
            if cuda:
                ready[j].record(side)

    outs = []
    for deq in deqs:
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        ready = [torch.cuda.Event() for _ in bounds] if cuda else []
        done = [torch.cuda.Event() for _ in bounds] if cuda else []
        if cuda:
            side.wait_stream(main)  # the previous layer's GEMMs read both workspaces
        fill(deq, 0, ready, done)
        for j, (a, b) in enumerate(bounds):
            if j + 1 < len(bounds):
                fill(deq, j + 1, ready, done)
            if cuda:
                main.wait_event(ready[j])
            torch.mm(x, ws[j % 2][: (b - a) * k].view(b - a, k).t(), out=out[:, a:b])
            if cuda:
                done[j].record(main)
        outs.append(out)
    if cuda:
        main.wait_stream(side)
    return outs


def run_dequant_gemm(x, gemms):  # type: ignore[no-untyped-def]
    return [g(x) for g in gemms]


def run_deq(x, deqs, n: int, k: int):  # type: ignore[no-untyped-def]
    ws = torch.empty(n, k, dtype=x.dtype, device=x.device)
    for rows in deqs:
        rows(0, n, ws)
    return ws


def run_bf16(x, w16s):  # type: ignore[no-untyped-def]
    return [torch.mm(x, w.t()) for w in w16s]


def _time_round_robin(fns: dict, reps: int, cuda: bool) -> dict[str, float]:  # type: ignore[type-arg]
    """Median us per way; every round runs each way once, so clock and thermal drift over the
    run hit all ways alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {w: [] for w in fns}
    for _ in range(reps):
        for way, fn in fns.items():
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times[way].append(time.perf_counter() - t0)
    return {w: 1e6 * statistics.median(v) for w, v in times.items()}


def measure(name: str, n: int, k: int, ms: list[int], layers: int, reps: int, device,
            slabs: int, slab_mi: tuple[float, ...] = ()):  # type: ignore[no-untyped-def]  # fmt: skip
    from quantdispatch.kernels.common.slabs import DequantGemm

    cuda = device.type == "cuda"
    made = [_dequantizer(n, k, device, seed) for seed in range(layers)]
    deqs, w16s, w64s = ([t[i] for t in made] for i in range(3))
    side = torch.cuda.Stream(device) if cuda else None
    hi = torch.cuda.Stream(device, priority=torch.cuda.Stream.priority_range()[1]) if cuda else None
    rows = []
    for m in ms:
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 0.5).to(device)
        x = x.to(torch.bfloat16)
        refs = [x.double() @ w.T for w in w64s]

        def rel_err(outs, refs=refs) -> float:  # type: ignore[no-untyped-def]
            return max(float((a.double() - r).norm() / r.norm().clamp(min=1e-30))
                       for a, r in zip(outs, refs, strict=True))  # fmt: skip

        ways = {
            "seq": lambda x=x: run_seq(x, deqs, n, k),
            "seq_out": lambda x=x: run_seq(x, deqs, n, k, into=True),
            "overlap": lambda x=x: run_overlap(x, deqs, n, k, side),
            "overlap_hi": lambda x=x: run_overlap(x, deqs, n, k, hi),
            "slabs": lambda x=x: run_slabs(x, deqs, n, k, hi, slabs),
        }
        for mi in slab_mi:
            gemms = [DequantGemm(n, k, d, workspace_elements=int(mi * 2**20)) for d in deqs]
            ways[f"slab{mi:g}M"] = lambda x=x, gemms=gemms: run_dequant_gemm(x, gemms)
        seq = ways["seq"]()
        row: dict = dict(shape=name, n=n, k=k, m=m, layers=layers, slabs=slabs)
        ok = {}
        for way, fn in ways.items():
            outs = seq if way == "seq" else fn()
            row[f"{way}_equals_seq"] = all(map(torch.equal, seq, outs))
            row[f"{way}_rel_err_vs_float64"] = err = rel_err(outs)
            # the overlaps run seq's kernels on seq's inputs: anything but its bits is a race
            exact_ways = (
                "overlap",
                "overlap_hi",
                "seq_out",
            )  # the others may run other cuBLAS kernels
            ok[way] = err < 1e-2 and (way not in exact_ways or row[f"{way}_equals_seq"])
        ways.update(deq=lambda x=x: run_deq(x, deqs, n, k), bf16=lambda x=x: run_bf16(x, w16s))
        timed = {w: fn for w, fn in ways.items() if ok.get(w, True)}
        t = {w: v / layers for w, v in _time_round_robin(timed, reps, cuda).items()}
        row.update({f"{w}_us": round(v, 1) for w, v in t.items()})
        row.update({f"bf16/{w}": round(t["bf16"] / t[w], 3) for w in ok if w in t})
        row["failed"] = [w for w, good in ok.items() if not good]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ms", default="256,512,1024,2048,4096")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--slabs", type=int, default=4, help="row slabs per weight (way ``slabs``)")
    p.add_argument("--slab-mi", default="", help="DequantGemm workspaces in Mi elements, e.g. 8,32")
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
        rows += measure(
            name,
            n,
            k,
            ms,
            a.layers if not a.smoke else 3,
            reps,
            device,
            a.slabs if not a.smoke else 1,
            tuple(float(v) for v in a.slab_mi.split(",") if v) if not a.smoke else (1 / 16,),
        )
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "dequant-overlap.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
