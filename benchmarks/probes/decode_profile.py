#!/usr/bin/env python3
"""Where a whole model's decode step spends its time: bf16 vs the same model quantized.

``model_decode.py`` measures tokens per second; this script explains them. Same models (Llama
shapes, random weights, ``quantize_model``), same ``generate`` settings. Per model and batch:

- GPU time per decode step, from torch.profiler's CUDA kernel records: kernels of
  ``generate(1 + S tokens)`` minus those of ``generate(1 token)``, divided by S, summed and per
  kernel name (the top ones are listed). This is the time the GPU is busy, without launch gaps;
- wall time per step in eager mode and in transformers' ``cudagraphs`` compile mode (as in
  model_decode.py), so wall - GPU is the host's share;
- per compile mode, the CPU operators that grow with the step count (torch.profiler, same
  subtraction) and a cProfile of the Python functions of ``generate(1 + S)`` (text files).

Writes ``decode-profile-<device>-<date>.json`` / ``.md`` and ``cprofile-<model>-<mode>.txt``
under ``--out``.

    PYTHONPATH=$PWD python3 benchmarks/probes/decode_profile.py [--batches 1,16] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import gc
import io
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import model_decode as md  # benchmarks/model_decode.py: models and settings

TOP = 14


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="llama-3.2-1b", choices=sorted(md.CONFIGS))
    p.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4", "fp8"])
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=16, help="S: decode steps profiled")
    p.add_argument("--modes", default="none,cudagraphs")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    return args


def _generate(model: Any, ids: torch.Tensor, n: int, mode: str) -> None:
    cc = md._compile_config(mode, ids.device)
    kw: dict[str, Any] = dict(do_sample=False, cache_implementation="static")
    kw.update(compile_config=cc) if cc is not None else kw.update(disable_compile=True)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=n, **kw)
    torch.cuda.synchronize()


def _profile(model: Any, ids: torch.Tensor, n: int, mode: str) -> tuple[dict, dict, float]:
    """(CUDA kernel us by name, CPU op self us by name, wall s) of one generate call."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        _generate(model, ids, n, mode)
        wall = time.perf_counter() - t0
    kernels: dict[str, float] = defaultdict(float)
    cpu: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type.name == "CUDA":  # kernels and copies; CPU ops' device totals repeat them
            kernels[e.key] += getattr(e, "self_device_time_total", 0.0)
        elif e.self_cpu_time_total:
            cpu[e.key] += e.self_cpu_time_total
    return kernels, cpu, wall


def _per_step(long: dict, short: dict, steps: int) -> dict[str, float]:
    keys = set(long) | set(short)
    return {k: (long.get(k, 0.0) - short.get(k, 0.0)) / steps for k in keys}


def _top(d: dict[str, float], n: int = TOP) -> list[tuple[str, float]]:
    return sorted(((k, round(v, 2)) for k, v in d.items()), key=lambda kv: -kv[1])[:n]


def _cprofile(model: Any, ids: torch.Tensor, n: int, mode: str, path: Path) -> None:
    prof = cProfile.Profile()
    prof.enable()
    _generate(model, ids, n, mode)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).strip_dirs()
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    path.write_text(buf.getvalue(), encoding="utf-8")


def measure(model: Any, label: str, args: argparse.Namespace, out: Path) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=g)
    for mode in args.modes:
        for batch in args.batches:
            ids = prompt.repeat(batch, 1).cuda()
            s = args.steps
            _generate(model, ids, 1 + s, mode)  # compiles kernels / the decode graph
            _generate(model, ids, 1 + s, mode)
            k1, c1, _ = _profile(model, ids, 1, mode)
            kn, cn, _ = _profile(model, ids, 1 + s, mode)
            t1 = min(_timed(model, ids, 1, mode) for _ in range(3))
            tn = min(_timed(model, ids, 1 + s, mode) for _ in range(3))
            kern = _per_step(kn, k1, s)
            cpu = _per_step(cn, c1, s)
            row = dict(model=label, mode=mode, batch=batch, steps=s)
            row["wall_ms_per_step"] = round(1e3 * (tn - t1) / s, 3)
            row["gpu_ms_per_step"] = round(sum(v for v in kern.values() if v > 0) / 1e3, 3)
            row["top_kernels_us"] = _top(kern)
            row["top_cpu_self_us"] = _top(cpu)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if batch == args.batches[0]:
                _cprofile(model, ids, 1 + s, mode, out / f"cprofile-{label}-{mode}.txt")
    return rows


def _timed(model: Any, ids: torch.Tensor, n: int, mode: str) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _generate(model, ids, n, mode)
    return time.perf_counter() - t0


def render(report: dict[str, Any]) -> str:
    lines = [
        f"# Decode step profile: {report['config']} ({report['format']} vs bf16)",
        "",
        f"{report['device']}; torch {torch.__version__}; {report['date']}. GPU = kernel time per "
        "step from torch.profiler; wall = generate's time per step; host = wall - GPU.",
        "",
        "| mode | batch | model | wall ms/step | GPU ms/step | host ms/step |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        host = r["wall_ms_per_step"] - r["gpu_ms_per_step"]
        lines.append(
            f"| {r['mode']} | {r['batch']} | {r['model']} | {r['wall_ms_per_step']:.2f} | "
            f"{r['gpu_ms_per_step']:.3f} | {host:.2f} |"
        )
    for r in report["rows"]:
        lines += ["", f"## {r['model']}, {r['mode']}, batch {r['batch']}", ""]
        lines += ["| kernel (us / step) | |", "|---|---|"]
        lines += [f"| `{k[:90]}` | {v} |" for k, v in r["top_kernels_us"]]
        lines += ["", "| CPU op, self (us / step) | |", "|---|---|"]
        lines += [f"| `{k[:90]}` | {v} |" for k, v in r["top_cpu_self_us"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from quantdispatch.integrations.transformers import quantize_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    name = torch.cuda.get_device_name()
    stem = out / f"decode-profile-{name.replace(' ', '-').lower()}-{now:%Y-%m-%d}"
    report: dict[str, Any] = dict(
        config=args.config, format=args.format, device=name,
        date=now.isoformat(timespec="seconds"), rows=[],
    )  # fmt: skip
    margs = md.parse_args(["--config", args.config, "--prompt-len", str(args.prompt_len)])
    for label in ("bf16", args.format):
        model = md.build_model(margs, torch.device("cuda"))
        if label != "bf16":
            quantize_model(model, args.format)
        report["rows"] += measure(model, label, args, out)
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1), encoding="utf-8")
        stem.with_suffix(".md").write_text(render(report), encoding="utf-8")
        del model
        gc.collect()
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
