"""Static SASS count of the mma.sync GEMV main loop, no GPU needed (Triton's bundled ptxas and
cuobjdump, target sm_90).

    python benchmarks/probes/sass_count.py             # the configs the heuristic uses at M=1 / 16
    python benchmarks/probes/sass_count.py 2,8,2,1,1   # NT,WT,WK,UNROLL,R

Prints, per config, the instructions of the longest loop (the K loop) by opcode; divide by
UNROLL for one 64-column chunk per warp. Used to tell issue-bound from memory-bound before
spending device time (docs/design/mma-layout.md).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from quantdispatch.kernels.mma_layout import gemv

SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*i16", "gs_ptr": "*fp32", "bias_ptr": "*fp32",
    "out_ptr": "*bf16", "M": "i32", "N": "i32", "stride_xm": "i32", "stride_om": "i32",
    "CHUNKS": "constexpr", "NT": "constexpr", "WT": "constexpr", "WK": "constexpr",
    "UNROLL": "constexpr", "R": "constexpr", "BF16": "constexpr", "HAS_BIAS": "constexpr",
    "DEPTH": "constexpr", "SPC": "constexpr",
}  # fmt: skip
LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")


def sass(nt: int, wt: int, wk: int, unroll: int, r: int, chunks: int = 64) -> str:
    consts = {"CHUNKS": chunks, "NT": nt, "WT": wt, "WK": wk, "UNROLL": unroll, "R": r,
              "BF16": True, "HAS_BIAS": False, "DEPTH": 1, "SPC": 32}  # fmt: skip
    src = ASTSource(fn=gemv._mma_gemv_kernel, signature=SIGNATURE, constexprs=consts)
    opts = {"num_warps": wt * wk, "num_stages": 1}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout


def longest_loop(text: str) -> list[str]:
    """The instructions between a backward branch's target and the branch, the longest such."""
    code = [(int(a, 16), ins) for a, ins in LINE.findall(text)]
    best: list[str] = []
    for addr, ins in code:
        m = re.search(r"BRA\s.*?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            body = [i for a, i in code if int(m.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    return best


def opcode(ins: str) -> str:
    words = ins.split()
    word = words[1] if words[0].startswith("@") else words[0]
    return word.split(".")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description="SASS of the GEMV's K loop per config (sm_90)")
    ap.add_argument("configs", nargs="*", help="NT,WT,WK,UNROLL,R (e.g. 1,1,8,4,1)")
    args = ap.parse_args()
    configs = [tuple(int(v) for v in a.split(",")) for a in args.configs] or [
        (1, 1, 4, 2, 1),  # M <= 8 on a 2^25+-element weight (gate_up)
        (2, 8, 2, 1, 1),  # M = 16 on it
    ]
    for cfg in configs:
        loop = longest_loop(sass(*cfg))
        ops = collections.Counter(opcode(i) for i in loop)
        per_chunk = len(loop) / cfg[3]
        print(f"NT,WT,WK,U,R={cfg}: {len(loop)} in the loop, {per_chunk:.0f} per chunk",
              dict(ops.most_common(12)))  # fmt: skip


if __name__ == "__main__":
    main()
