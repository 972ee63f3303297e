"""The shapes, markdown, crossovers and target checks of benchmarks/fp8_prefill.py."""

from __future__ import annotations

import json

COLUMNS = ["bf16", "wo", "fp8", "fp8_res"]
SHAPES = {
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
           ("down", 4096, 14336)],
    "70b": [("qkv", 10240, 8192), ("o", 8192, 8192), ("gate_up", 57344, 8192),
            ("down", 8192, 28672)],
    "tiny": [("tiny", 128, 256)],  # the CPU smoke run
}  # fmt: skip


def crossover(rows: list[dict], model: str, name: str, col: str, base: str) -> int | None:
    """Smallest M from which ``col`` is faster than ``base`` at every larger M measured."""
    best = None
    for m, t in sorted(_times(rows, model, name).items(), reverse=True):
        a, b = t.get(col), t.get(base)
        if a is None or b is None or a >= b:
            break
        best = m
    return best


def _times(rows, model, name) -> dict[int, dict[str, float | None]]:
    out: dict[int, dict[str, float | None]] = {}
    for r in rows:
        if r["model"] == model and r["shape"] == name:
            out.setdefault(r["M"], {})[r["column"]] = r["us"]
    return out


def markdown(meta: dict, rows: list[dict]) -> str:
    o = [
        f"# FP8 prefill on {meta['device']} ({meta['date']})",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, driver "
        f"{meta['driver']}. NVFP4 weights (quantize_nvfp4 of N(0, 0.02), 1/64 of rows x1e-3: "
        "subnormal block scales), bf16 activations N(0, 1). Median us per call over CUDA-graph "
        "replays, weights and activations rotated past L2. bf16 = cuBLAS on the dequantized "
        "weight; wo = QuantLinear (triton backend, weight-only); fp8 = FP8 prefill "
        "re-encoding per call; res = FP8 prefill on a resident FP8 copy. err = ||y - y64|| / "
        "||y64|| on the first 512 rows, y64 = float64 x @ W^T (the W4A16 result); bound = max "
        "|y_fp8 - y64| / (proven componentwise bound), first 64 rows (<= 1 required).",
        "",
    ]
    for model in meta["models"]:
        o += [
            f"## {model}: speed-up over bf16 (wo / fp8 / res) and time (us)",
            "",
            "| shape | M | bf16 us | wo us | fp8 us | res us | wo | fp8 | res | fp8 vs wo |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, n, k in SHAPES.get(model, []):
            for m, t in sorted(_times(rows, model, name).items()):
                cell = lambda c, t=t: f"{t[c]:.1f}" if t.get(c) else "FAIL"
                sp = lambda c, t=t: (
                    f"{t['bf16'] / t[c]:.2f}x" if t.get(c) and t.get("bf16") else "-"
                )
                vs = f"{t['wo'] / t['fp8']:.2f}x" if t.get("wo") and t.get("fp8") else "-"
                o.append(
                    f"| {name} {n}x{k} | {m} | {cell('bf16')} | {cell('wo')} | "
                    f"{cell('fp8')} | {cell('fp8_res')} | {sp('wo')} | {sp('fp8')} | "
                    f"{sp('fp8_res')} | {vs} |"
                )
        o += [
            "",
            f"## {model}: accuracy",
            "",
            "| shape | M | err bf16 | err wo | err fp8 | fp8 vs wo | bound | res == fp8 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, _, _ in SHAPES.get(model, []):
            by = {
                (r["M"], r["column"]): r for r in rows if r["model"] == model and r["shape"] == name
            }
            for m in sorted({mm for mm, _ in by}):
                f = by.get((m, "fp8"), {})
                e = lambda c, m=m, by=by: f"{by[(m, c)]['err']:.2e}" if (m, c) in by else "-"
                o.append(
                    f"| {name} | {m} | {e('bf16')} | {e('wo')} | {e('fp8')} | "
                    f"{f.get('vs_wo', float('nan')):.2e} | "
                    f"{f.get('bound_ratio', float('nan')):.3f} | {f.get('res_equal')} |"
                )
        o += [
            "",
            f"## {model}: crossover M (the smallest M from which it is faster at every "
            "larger M measured; - = never)",
            "",
            "| shape | recipe | fp8 > bf16 | fp8 > wo | res > bf16 | res > wo | resident MB "
            "| re-encode us (TB/s) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, _, _ in SHAPES.get(model, []):
            info = next((r for r in rows if r["model"] == model and r["shape"] == name), None)
            if info is None:
                continue
            c = [
                crossover(rows, model, name, a, b) or "-"
                for a, b in (("fp8", "bf16"), ("fp8", "wo"), ("fp8_res", "bf16"), ("fp8_res", "wo"))
            ]
            re_us = info.get("reencode_us")
            re_txt = f"{re_us:.1f} ({info['reencode_TBps']:.2f})" if re_us else "-"
            o.append(
                f"| {name} | {info['recipe']} | "
                + " | ".join(map(str, c))
                + f" | {info['resident_bytes'] / 1e6:.1f} | {re_txt} |"
            )
    o += ["", "## Targets (8B shapes: fp8 >= 1.5x bf16 for M >= 1024, >= 1.2x at M = 256)", ""]
    for line in meta.get("targets", []):
        o.append(f"- {line}")
    extra = [r for r in rows if r["column"] not in COLUMNS]
    if extra:
        o += [
            "",
            "## Extras (8B)",
            "",
            "| shape | M | column | us | err | bound / note |",
            "|---|---|---|---|---|---|",
        ]
        for r in extra:
            us = f"{r['us']:.1f}" if r.get("us") else "-"
            note = r.get("bound_ratio", r.get("equal_values", ""))
            o.append(
                f"| {r['shape']} | {r['M']} | {r['column']} | {us} | {r['err']:.2e} | {note} |"
            )
    if meta.get("gemm_notes"):
        o += ["", "GEMM forms that fell back: " + json.dumps(meta["gemm_notes"])]
    return "\n".join(o) + "\n"


def targets(rows: list[dict]) -> list[str]:
    out = []
    for name, _, _ in SHAPES["8b"]:
        t = _times(rows, "8b", name)
        for m, need in sorted(
            (m, 1.5 if m >= 1024 else 1.2) for m in t if m >= 256 and (m >= 1024 or m == 256)
        ):
            for col in ("fp8", "fp8_res"):
                a, b = t[m].get(col), t[m].get("bf16")
                if a and b:
                    sp = b / a
                    out.append(
                        f"{name} M={m} {col}: {sp:.2f}x (need {need}x) "
                        f"{'MET' if sp >= need else 'MISSED'}"
                    )
    return out
