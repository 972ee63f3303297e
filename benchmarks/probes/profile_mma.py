"""A few calls of one NVFP4 kernel for a profiler to capture (Nsight Compute), e.g.

    ncu --kernel-name regex:_mma --launch-skip 3 --launch-count 1 --set full \
        python benchmarks/probes/profile_mma.py --shape gate_up --m 64

``--kernel mma`` is the repacked mma16x64 linear kernel, ``gemm`` the wgmma GEMM on the same
layout (its heuristic tile), ``ckpt`` the checkpoint-layout one,
``moe`` the fused MoE on Qwen3-30B-A3B experts (M tokens, top 8 of 128; checkpoint layout),
``moe-repacked`` what QuantMoE runs on the same experts (repacked, its heuristic; other experts
with ``--moe-shape E,TOPK,H,I``, the 8-pair-block kernels with given K splits with
``--moe-split WKxU/WKxU``, gate/up / down). Prints the time of the last call so a run without
the profiler is a quick check too.
"""

from __future__ import annotations

import argparse
import math

import torch
from ckpt_mma_linear import mma_ckpt_linear  # probes/: the checkpoint-layout LINEAR mode

from quantdispatch.kernels.checkpoint_layout.moe import fused_moe
from quantdispatch.kernels.common.moe_plan import MmaGemmConfig, MmaMoeConfig
from quantdispatch.kernels.mma_layout.gemm import mma_gemm
from quantdispatch.kernels.mma_layout.gemm_tiles import parse_tile
from quantdispatch.kernels.mma_layout.gemv import mma_linear
from quantdispatch.kernels.mma_layout.layout import repack
from quantdispatch.kernels.mma_layout.moe_gemm import mma_layout_moe
from quantdispatch.kernels.mma_layout.moe_stacks import repack_experts

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    ap = argparse.ArgumentParser()
    kernels = ["mma", "gemm", "ckpt", "moe", "moe-repacked"]
    ap.add_argument("--kernel", default="mma", choices=kernels)
    ap.add_argument("--shape", default="gate_up", choices=list(SHAPES))
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--config", default="", help="NT,WT,WK,UNROLL (linear kernels)")
    ap.add_argument("--tile", default="", help="BNxBMxBKwWsS[kS][rR] (gemm; default: heuristic)")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--moe-shape", default="128,8,2048,768", help="E,TOPK,H,I (moe kernels)")
    ap.add_argument("--moe-split", default="", help="WKxU/WKxU: 8-pair blocks, gate/up / down")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    cfg = tuple(int(v) for v in args.config.split(",")) if args.config else None
    if args.kernel.startswith("moe"):
        e, top_k, h, i = (int(v) for v in args.moe_shape.split(","))
        moe_cfg = None
        if args.moe_split:
            g1, g2 = (tuple(int(v) for v in part.split("x")) for part in args.moe_split.split("/"))
            moe_cfg = MmaMoeConfig(1, MmaGemmConfig(1, *g1), MmaGemmConfig(1, *g2))

        def stack(n: int, k: int) -> list[torch.Tensor]:
            packed = torch.randint(0, 256, (e, n, k // 2), generator=g, device=dev).to(torch.uint8)
            bits = torch.randint(0x28, 0x48, (e, n, k // 16), generator=g, device=dev)
            gs = torch.full((e,), 1 / (3 * math.sqrt(k)), device=dev)
            return [packed, bits.to(torch.uint8).view(torch.float8_e4m3fn), gs]

        w13, w2 = stack(2 * i, h), stack(h, i)
        x = torch.randn(args.m, h, generator=g, device=dev).to(torch.bfloat16)
        ids = torch.randn(args.m, e, generator=g, device=dev).topk(top_k, -1).indices.int()
        tw = torch.full((args.m, top_k), 1 / top_k, device=dev)

        if args.kernel == "moe-repacked":
            r13 = [*repack_experts(w13[0], w13[1].view(torch.uint8), x.dtype), w13[2]]
            r2 = [*repack_experts(w2[0], w2[1].view(torch.uint8), x.dtype), w2[2]]

            def call() -> torch.Tensor:
                return mma_layout_moe(x, ids, tw, r13, r2, None, None,
                                                  activation="silu", params=[],
                                                  packed_for=x.dtype, config=moe_cfg)  # fmt: skip
        else:

            def call() -> torch.Tensor:
                return fused_moe(x, ids, tw, w13, w2, None, None, fmt="nvfp4",
                                           activation="silu", params=[])  # fmt: skip
    else:
        n, k = SHAPES[args.shape]
        packed = torch.randint(0, 256, (n, k // 2), generator=g, device=dev).to(torch.uint8)
        bits = torch.randint(0x28, 0x48, (n, k // 16), generator=g, device=dev).to(torch.uint8)
        gs = torch.tensor(1e-2, device=dev)
        x = torch.randn(args.m, k, generator=g, device=dev).to(torch.bfloat16)
        if args.kernel == "mma":
            words, scales = repack(packed, bits, torch.bfloat16)

            def call() -> torch.Tensor:
                return mma_linear(x, words, scales, gs, config=cfg)
        elif args.kernel == "gemm":
            words, scales = repack(packed, bits, torch.bfloat16)
            tile = parse_tile(args.tile) if args.tile else None

            def call() -> torch.Tensor:
                return mma_gemm(x, words, scales, gs, tile=tile)
        else:

            def call() -> torch.Tensor:
                return mma_ckpt_linear(x, packed, bits, gs, config=cfg)

    for _ in range(args.calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3
    print(f"{args.kernel} {args.shape} M={args.m}: last call {us:.1f} us")


if __name__ == "__main__":
    main()
