#!/usr/bin/env python3
"""Time to first token of a Llama-3-8B-shaped HF model: one eager prefill, per prompt length.

A model with the Llama-3-8B configuration (32 layers, hidden 4096, intermediate 14336, GQA 32/8
heads, vocab 128256) and random bf16 weights runs one forward over a batch-1 prompt
(``logits_to_keep=1``, SDPA attention, no cache reuse), as ``generate`` does before its first
token. Variants:

- ``bf16``: the model unquantized (cuBLAS);
- ``nvfp4``: ``quantize_model(..., "nvfp4")`` with FP8 compute off (weight-only kernels);
- ``nvfp4 fp8``: the same with ``fp8_compute="prefill-resident"``, as ``quantize_model``
  installs it (the norms and the MLP produce the FP8 activations);
- ``nvfp4 fp8, no producers``: that model after ``remove_fp8_producers`` (each FP8 linear
  quantizes its own input, as before the producers and the handoff).

Per variant and length: the median of ``--reps`` timed forwards after one warm-up (Triton
compiles there), and for the FP8 variants how many linear calls took their codes from the
handoff or quantized themselves in one forward. The lm_head stays bf16 in every variant.

    PYTHONPATH=$PWD python3 benchmarks/model_prefill.py [--lens 256,1024,4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
)  # fmt: skip


def log(*a: object) -> None:
    print(*a, flush=True)


def build(layers: int) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": layers}, bos_token_id=None,
                      eos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.eval()


def time_prefill(model: Any, lens: list[int], reps: int) -> dict[int, dict[str, Any]]:
    from quantdispatch.integrations.transformers import fp8_handoff

    out = {}
    g = torch.Generator().manual_seed(1)
    for n in lens:
        ids = torch.randint(0, LLAMA3_8B["vocab_size"], (1, n), generator=g).cuda()
        with torch.no_grad():
            model(ids, logits_to_keep=1)  # warm-up: Triton compiles for this M
            fp8_handoff.clear()
            model(ids, logits_to_keep=1)
            shared = fp8_handoff.counts()
            wall, gpu = [], []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                a.record()
                model(ids, logits_to_keep=1)
                b.record()
                torch.cuda.synchronize()
                wall.append((time.perf_counter() - t0) * 1e3)
                gpu.append(a.elapsed_time(b))
        out[n] = {"ms": statistics.median(wall), "gpu_ms": statistics.median(gpu),
                  "wall_all": wall, **shared}  # fmt: skip
        log(
            f"  {n} tokens: {out[n]['ms']:.2f} ms (GPU events {out[n]['gpu_ms']:.2f}; reps "
            + " ".join(f"{t:.1f}" for t in wall)
            + f")  shared/quantized {shared}"
        )
    return out


def profile(model: Any, n: int, name: str) -> None:
    """Top host-time entries of one forward over ``n`` tokens (torch.profiler, CPU + CUDA)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    ids = torch.randint(0, LLAMA3_8B["vocab_size"], (1, n)).cuda()
    with torch.no_grad():
        model(ids, logits_to_keep=1)
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            model(ids, logits_to_keep=1)
            torch.cuda.synchronize()
    log(f"profile {name}, {n} tokens:")
    log(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    log(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    import cProfile
    import io
    import pstats

    with torch.no_grad():
        torch.cuda.synchronize()
        cp = cProfile.Profile()
        cp.enable()
        model(ids, logits_to_keep=1)
        torch.cuda.synchronize()
        cp.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(cp, stream=buf).sort_stats(key).print_stats(30)
        log(f"cProfile {name}, {n} tokens, by {key}:")
        log(buf.getvalue())


def render(report: dict[str, Any]) -> str:
    lens = report["lens"]
    rows = report["variants"]
    base = rows["bf16"]
    lines = [
        f"# Prefill (time to first token) of a Llama-3-8B-shaped model on {report['device']}",
        "",
        f"{report['date']}, torch {report['torch']}, transformers {report['transformers']}; "
        f"{report['layers']} decoder layers, random bf16 weights, batch 1, eager forward with "
        "SDPA, median wall ms of "
        f"{report['reps']} after a warm-up (GPU time between CUDA events in brackets where it "
        "differs by more than 10%); x = speed-up over bf16.",
        "",
        "| variant | " + " | ".join(f"{n} tokens" for n in lens) + " |",
        "|---|" + "---|" * len(lens),
    ]
    for name, r in rows.items():
        cells = []
        for n in lens:
            c = r[str(n)]
            cell = f"{c['ms']:.1f} ({base[str(n)]['ms'] / c['ms']:.2f}x)"
            if abs(c["gpu_ms"] - c["ms"]) > 0.1 * c["ms"]:
                cell += f" [GPU {c['gpu_ms']:.1f}]"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Linear calls per forward that took their codes from the handoff / quantized:"]
    for name, r in rows.items():
        if "fp8" in name:
            lines.append(f"- {name}: {r[str(lens[-1])]['hits']} / {r[str(lens[-1])]['misses']}")
    return "\n".join(lines) + "\n"


def main() -> int:
    import transformers

    from quantdispatch import load_settings
    from quantdispatch.integrations.transformers import quantize_model
    from quantdispatch.integrations.transformers.fp8_producers import remove_fp8_producers

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", default="256,1024,2048,4096,8192")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        help="also profile one forward of each variant at this length (CPU time)",
    )
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    lens = [int(v) for v in args.lens.split(",")]
    base = build(args.layers)
    variants: dict[str, Any] = {}
    log("bf16")
    variants["bf16"] = time_prefill(base, lens, args.reps)
    if args.profile:
        profile(base, args.profile, "bf16")
    for mode in ("off", "prefill-resident"):
        t0 = time.time()
        model = quantize_model(copy.deepcopy(base), "nvfp4",
                               settings=load_settings({}, fp8_compute=mode))  # fmt: skip
        torch.cuda.synchronize()
        name = "nvfp4" if mode == "off" else "nvfp4 fp8"
        log(f"{name} (quantized in {time.time() - t0:.0f} s)")
        variants[name] = time_prefill(model, lens, args.reps)
        if args.profile:
            profile(model, args.profile, name)
        if mode != "off":
            log(f"{name}, no producers ({remove_fp8_producers(model)} modules restored)")
            variants[f"{name}, no producers"] = time_prefill(model, lens, args.reps)
        del model
        torch.cuda.empty_cache()
    now = dt.datetime.now(dt.UTC)
    report = dict(
        device=torch.cuda.get_device_name(), date=now.isoformat(timespec="seconds"),
        torch=torch.__version__, transformers=transformers.__version__, layers=args.layers,
        reps=args.reps, lens=lens,
        variants={k: {str(n): v for n, v in r.items()} for k, r in variants.items()},
    )  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"model-prefill-llama3-8b-h200-{now:%Y-%m-%d}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    stem.with_suffix(".md").write_text(render(report), encoding="utf-8")
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
