#!/usr/bin/env python3
"""Does torch's row-wise FP8 grouped GEMM pay for MoE prefill? A probe on the GPU.

Per MoE shape (Qwen3-30B-A3B, Mixtral-8x7B experts) and tokens per expert: ``torch._grouped_mm``
on bf16 experts (what the dequantize path runs after dequantizing) against
``torch._scaled_grouped_mm`` on e4m3 experts with one scale per expert row and activations with
one scale per token (the only FP8 scaling torch's grouped GEMM takes on SM 9.0), with even and
uneven (odd-sized) expert groups. The FP8 output is checked against float64 of the same e4m3
operands on every row of three experts before it is timed; the activation quantizer (per token
over all K, hardware rounding) is timed too. Writes fp8-grouped-probe-<gpu>-<date>.md / .json.

    PYTHONPATH=$PWD python3 benchmarks/probes/fp8_grouped_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

#: (name, experts, N, K): each GEMM of a gated MoE (w13: 2I x H, w2: H x I)
SHAPES = [
    ("qwen3-30b-a3b w13", 128, 1536, 2048),
    ("qwen3-30b-a3b w2", 128, 2048, 768),
    ("mixtral-8x7b w13", 8, 28672, 4096),
    ("mixtral-8x7b w2", 8, 4096, 14336),
]
TOKENS_PER_EXPERT = [256, 1024, 4096]


def log(*a: object) -> None:
    print(*a, flush=True)


def offsets(e: int, t: int, uneven: bool, g: torch.Generator) -> torch.Tensor:
    """Cumulative group ends (int32): t rows per expert, or random odd-sized groups of the same
    total."""
    if not uneven:
        counts = torch.full((e,), t)
    else:
        w = torch.rand(e, generator=g) + 0.2
        counts = (w / w.sum() * e * t).floor().long()
        counts = counts | 1  # odd sizes
        counts[-1] += e * t - int(counts.sum())
        counts = counts.clamp_min(0)
    return torch.cumsum(counts, 0).to(torch.int32).cuda()


def probe(name, e, n, k, t, uneven, g) -> dict:
    import linear as L  # benchmarks/linear.py

    from quantdispatch.kernels.native.fp8_prefill_quant import quantize_blocks_triton

    offs = offsets(e, t, uneven, g)
    m = int(offs[-1])
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    wq = (torch.randn(e, n, k, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    sb = torch.pow(2.0, torch.randint(-14, -6, (e, n), device="cuda").float())
    wb = (wq.float() * sb[:, :, None]).to(torch.bfloat16)
    xq = torch.empty((m, k), dtype=torch.uint8, device="cuda")
    sa = torch.empty((m, 1), device="cuda")
    quantize_blocks_triton(x, xq, sa, block_cols=k)
    xq = xq.view(torch.float8_e4m3fn)
    row = {"shape": name, "E": e, "N": n, "K": k, "tokens_per_expert": t, "uneven": uneven}
    try:
        y = torch._scaled_grouped_mm(
            xq, wq.transpose(1, 2), sa.view(-1), sb, offs=offs, out_dtype=torch.bfloat16
        )
    except Exception as exc:  # what this torch build rejects
        row["error"] = str(exc).splitlines()[0][:200]
        return row
    starts = torch.cat([offs.new_zeros(1), offs[:-1]]).tolist()
    ends = offs.tolist()
    errs = []
    for j in (0, e // 2, e - 1):
        a, b = starts[j], ends[j]
        if b <= a:
            continue
        ref = (xq[a:b].double() * sa[a:b].double()) @ (wq[j].double() * sb[j].double()[:, None]).T
        errs.append(float((y[a:b].double() - ref).norm() / ref.norm().clamp_min(1e-30)))
    row["err"] = max(errs) if errs else None
    ok = row["err"] is not None and row["err"] < 1e-2
    row["ok"] = ok
    reps = 5

    def bf16():
        torch._grouped_mm(x, wb.transpose(1, 2), offs=offs)

    def fp8():
        torch._scaled_grouped_mm(
            xq, wq.transpose(1, 2), sa.view(-1), sb, offs=offs, out_dtype=torch.bfloat16
        )

    def quant():
        q = torch.empty((m, k), dtype=torch.uint8, device="cuda")
        s = torch.empty((m, 1), device="cuda")
        quantize_blocks_triton(x, q, s, block_cols=k)

    row["bf16_us"] = L.time_calls([bf16], reps)
    row["fp8_us"] = L.time_calls([fp8], reps) if ok else None
    row["quant_us"] = L.time_calls([quant], reps)
    row["flops"] = 2.0 * m * n * k
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = ap.parse_args()
    import linear as L

    L.copy_bandwidth()
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, e, n, k in SHAPES:
        for t in TOKENS_PER_EXPERT:
            for uneven in (False, True):
                r = probe(name, e, n, k, t, uneven, g)
                rows.append(r)
                if "error" in r:
                    log(f"{name} t={t} uneven={uneven}: {r['error']}")
                    continue
                sp = r["bf16_us"] / r["fp8_us"] if r["fp8_us"] else 0.0
                tf = r["flops"] / (r["fp8_us"] * 1e-6) / 1e12 if r["fp8_us"] else 0.0
                log(
                    f"{name} t={t} uneven={uneven}: bf16 {r['bf16_us']:.1f} us, fp8 "
                    f"{r['fp8_us'] or 0:.1f} us ({sp:.2f}x, {tf:.0f} TFLOP/s), quant "
                    f"{r['quant_us']:.1f} us, err {r['err']:.1e}"
                )
    meta = {
        "device": torch.cuda.get_device_name(),
        "date": dt.date.today().isoformat(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = meta["device"].lower().replace("nvidia ", "").replace(" ", "-")
    base = out / f"fp8-grouped-probe-{slug}-{meta['date']}"
    base.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        f"# FP8 grouped GEMM probe on {meta['device']} ({meta['date']})",
        "",
        f"torch {meta['torch']}, CUDA {meta['cuda']}. One GEMM of a MoE layer: bf16 "
        "`torch._grouped_mm` vs row-wise FP8 `torch._scaled_grouped_mm` (same e4m3 operands; "
        "err vs float64 on three experts' rows), median us of CUDA-graph replays (not rotated "
        "past L2); quant = per-token activation quantizer.",
        "",
        "| GEMM | E | N x K | tokens / expert | groups | bf16 us | fp8 us | fp8 / bf16 | quant us "
        "| (fp8 + quant) / bf16 | err |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            kind = "uneven" if r["uneven"] else "even"
            lines.append(
                f"| {r['shape']} | {r['E']} | | {r['tokens_per_expert']} | {kind} | "
                f"error: {r['error']} |"
            )
            continue
        f8 = r["fp8_us"]
        lines.append(
            f"| {r['shape']} | {r['E']} | {r['N']}x{r['K']} | {r['tokens_per_expert']} | "
            f"{'uneven' if r['uneven'] else 'even'} | {r['bf16_us']:.1f} | "
            f"{f8:.1f} | {r['bf16_us'] / f8:.2f}x | {r['quant_us']:.1f} | "
            f"{r['bf16_us'] / (f8 + r['quant_us']):.2f}x | {r['err']:.1e} |"
            if f8
            else f"| {r['shape']} | {r['E']} | {r['N']}x{r['K']} | {r['tokens_per_expert']} | "
            f"| {r['bf16_us']:.1f} | failed check | | | | {r['err']} |"
        )
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    log(f"wrote {base}.md")


if __name__ == "__main__":
    main()
