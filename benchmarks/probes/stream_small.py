#!/usr/bin/env python3
"""How long does merely *reading* a small weight take? The floor the linear / MoE targets use is
bytes / the large-copy bandwidth (4.24 TB/s on the H200); for the 9-21 MB that one decode-time
layer streams, a kernel's launch, ramp and tail are not small against that.

Times, in CUDA graphs with the buffers rotated past L2 (as benchmarks/linear.py does), a
Triton kernel that only reads N bytes (16-byte loads, one int32 sum per program so nothing is
optimized away) for the NVFP4 bytes of each benchmark shape at M = 1, and chains of dependent
reads shaped like one MoE call (gate/up bytes, then down bytes, then the top-k sum's rows).
Prints and writes a markdown table: us, effective TB/s, and us / (bytes / 4.24 TB/s).

    PYTHONPATH=$PWD python3 benchmarks/probes/stream_small.py [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from linear import time_calls  # benchmarks/linear.py: median us per call over graph replays

FLOOR_TBPS = 4.24  # the large-copy streaming rate of the linear / MoE floors (anchors)
L2_ROTATE_BYTES = 400 * 2**20  # buffers per size cover this much, > 8x the H200's L2

SINGLE = {  # NVFP4 bytes (codes + e4m3 scales) of the linear benchmark shapes at M = 1
    "o 4096x4096": 4096 * 4096 * 9 // 16,
    "qkv 6144x4096": 6144 * 4096 * 9 // 16,
    "down 4096x14336": 4096 * 14336 * 9 // 16,
    "gate_up 28672x4096": 28672 * 4096 * 9 // 16,
}
CHAINS = {  # one MoE call at M = 1: gate/up of the experts touched, down, the top-k rows
    "Qwen3-30B-A3B M=1 (8 experts)": (8 * 1536 * 2048 * 9 // 16, 8 * 2048 * 768 * 9 // 16,
                                      8 * 2048 * 2),
    "Mixtral-8x7B M=1 (2 experts)": (2 * 28672 * 4096 * 9 // 16, 2 * 4096 * 14336 * 9 // 16,
                                     2 * 4096 * 2),
}  # fmt: skip


@triton.jit
def _read_kernel(src, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src + offs, mask=offs < n, other=0)
    tl.store(out + tl.program_id(0), tl.sum(v, axis=0))


def read(buf: torch.Tensor, out: torch.Tensor) -> None:
    n = buf.numel()
    block = 4096  # int32: 16 KB per program
    _read_kernel[(triton.cdiv(n, block),)](buf, out, n, BLOCK=block, num_warps=4)


def buffers(nbytes: int) -> list[torch.Tensor]:
    count = max(2, L2_ROTATE_BYTES // max(nbytes, 1))
    return [torch.ones(nbytes // 4, dtype=torch.int32, device="cuda") for _ in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = ap.parse_args()
    rows = []
    for name, nbytes in SINGLE.items():
        bufs = buffers(nbytes)
        out = torch.empty(triton.cdiv(nbytes // 4, 4096), dtype=torch.int32, device="cuda")
        us = time_calls([lambda b=b, out=out: read(b, out) for b in bufs], 20)
        rows.append((name, "1 read", nbytes, us))
        del bufs
    for name, parts in CHAINS.items():
        sets = buffers(sum(parts))
        views = []
        for b in sets:  # carve each rotation buffer into the chain's parts
            off, vs = 0, []
            for p in parts:
                vs.append(b[off // 4 : (off + p) // 4])
                off += p
            views.append(vs)
        outs = [torch.empty(triton.cdiv(p // 4, 4096), dtype=torch.int32, device="cuda")
                for p in parts]  # fmt: skip

        def chain(vs, outs=outs):
            for v, o in zip(vs, outs, strict=True):
                read(v, o)

        us = time_calls([lambda vs=vs: chain(vs) for vs in views], 20)
        rows.append((name, f"{len(parts)} dependent reads", sum(parts), us))
        del sets, views
    date = dt.date.today().isoformat()
    dev = torch.cuda.get_device_name()
    lines = [
        f"# Reading small weights on {dev} ({date})",
        "",
        f"torch {torch.__version__}, triton {triton.__version__}. A Triton kernel that only "
        "reads the bytes (16 KB per program, 4 warps), in CUDA graphs, buffers rotated past "
        f"L2; floor = bytes / {FLOOR_TBPS} TB/s (the large-copy rate the linear and MoE "
        "targets use).",
        "",
        "| what | kernels | MB | us | TB/s | us / floor |",
        "|---|---|---|---|---|---|",
    ]
    for name, kind, nbytes, us in rows:
        floor = nbytes / (FLOOR_TBPS * 1e12) * 1e6
        lines.append(
            f"| {name} | {kind} | {nbytes / 1e6:.1f} | {us:.2f} | {nbytes / us / 1e6:.2f} | "
            f"{us / floor:.2f}x |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    slug = dev.lower().replace("nvidia ", "").replace(" ", "-")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"stream-small-{slug}-{date}.md").write_text(text)


if __name__ == "__main__":
    main()
