#!/usr/bin/env python3
"""Whole-model accuracy of FP8 compute for prefill: a small Llama-style model's logits.

One bf16 model with random weights (fixed seed) is quantized with ``quantize_model`` three times,
with ``fp8_compute`` = off (weight-only kernels), prefill (per-call re-encoding) and
prefill-resident. Each runs one prefill of ``batch x seq`` tokens (M = batch * seq rows per
linear, at or above both FP8 rows' first M on SM 9.0). Two float64 references, both the same
model with float64 activations between the linears:

- W4A16: every quantized weight replaced by its float64 dequantization (the checkpoint's
  semantics, the reference ``verify`` uses per layer): the error FP8 compute adds, its accuracy;
- FP8 rule: every quantized linear computes (e4m3 activations per 1 x 128, rounded from bf16) @
  (the weight re-encoded by the rule of quantdispatch.formats.fp8_prefill) in float64: what the
  FP8 kernels must compute. Compared two ways: the whole model's logits (which also carry the
  bf16 roundings between layers, amplified where they move an e4m3 rounding), and every
  quantized layer's output against the rule applied to that layer's own input in the model
  (the kernels' error alone: the correctness check).

Reported per mode: the kernel family the layers' decision names for that M, the logits' relative
error ||y - ref|| / ||ref|| against each reference, the largest error over the largest reference
logit, and the share of positions whose arg-max agrees with the W4A16 reference's. For scale,
one more row: the unquantized bf16 model against the W4A16 reference (the change that quantizing
the weights to FP4 itself makes). Also how many norms / MLPs ``quantize_model`` set to produce
FP8 activations, and how many linear calls took their codes from the handoff (shared) or
quantized their input themselves.

    PYTHONPATH=$PWD python3 benchmarks/fp8_logits.py [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG: dict[str, Any] = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=4096,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
MODES = ("off", "prefill", "prefill-resident")


def float_model(device: torch.device, seed: int = 0) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(**CONFIG, bos_token_id=None, eos_token_id=None)
    with device:
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.eval()


def _codec(fmt: str) -> tuple[Any, Any]:
    from quantdispatch.formats.mxfp4 import dequantize_mxfp4, quantize_mxfp4
    from quantdispatch.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4

    return {
        "nvfp4": (quantize_nvfp4, dequantize_nvfp4),
        "mxfp4": (quantize_mxfp4, dequantize_mxfp4),
    }[fmt]


def reference(model: Any, fmt: str) -> Any:
    """float64 copy whose quantized linears hold their dequantized weights (lm_head stays)."""
    quantize, dequantize = _codec(fmt)
    ref = copy.deepcopy(model)
    for name, mod in ref.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            with torch.no_grad():
                mod.weight.data = dequantize(quantize(mod.weight.data), dtype=torch.float64)
    return ref.to(torch.float64)


class Fp8RuleLinear(torch.nn.Module):
    """float64 x -> bf16 -> e4m3 per 1 x 128 (the rule) -> @ the rule's re-encoded weight."""

    def __init__(self, linear: torch.nn.Linear, fmt: str) -> None:
        super().__init__()
        from quantdispatch.formats import fp8_prefill as rule
        from quantdispatch.kernels.native.fp8_prefill import block_recipe, weight_blocks

        quantize, _ = _codec(fmt)
        w = quantize(linear.weight.data)
        n, k = w.packed.shape[0], w.packed.shape[1] * 2
        br, bc = weight_blocks(block_recipe(k), k)
        scale_format = "e4m3" if fmt == "nvfp4" else "e8m0"
        gs = getattr(w, "global_scale", None)
        codes, scales = rule.reencode_fp4_torch(
            w.packed, w.block_scale.view(torch.uint8), gs, scale_format=scale_format,
            block_rows=br, block_cols=bc,
        )  # fmt: skip
        full = scales.repeat_interleave(br, 0)[:n].repeat_interleave(bc, 1)
        self.weight = torch.nn.Parameter(_e4m3(codes) * full.double(), requires_grad=False)
        self.bias = linear.bias
        self.rule = rule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k).to(torch.bfloat16)
        codes, scales = self.rule.quantize_blocks_torch(x2, block_rows=1, block_cols=128)
        xq = _e4m3(codes) * scales.double().repeat_interleave(128, 1)
        y = xq @ self.weight.T
        if self.bias is not None:
            y = y + self.bias.double()
        return y.reshape(*lead, -1)


def _e4m3(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).to(torch.float64)


def fp8_reference(model: Any, fmt: str) -> Any:
    """float64 copy whose quantized linears compute the FP8 rule (lm_head stays)."""
    ref = copy.deepcopy(model).to(torch.float64)
    for name, mod in list(ref.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, torch.nn.Linear) and full != "lm_head":
                setattr(mod, child_name, Fp8RuleLinear(child, fmt))
    return ref


def _recorder(seen: dict[str, Any], name: str) -> Any:
    """A forward hook keeping a layer's (input, output) under its name."""

    def hook(module: Any, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        seen[name] = (args[0], out)

    return hook


def _producers(model: Any) -> int:
    """How many norms / MLPs of the model were set to produce FP8 activations."""
    from quantdispatch.integrations.transformers import fp8_producers

    return sum(hasattr(x, fp8_producers.PATCHED) for x in model.modules())


def _layers_vs_rule(
    base: Any, seen: dict[str, tuple[torch.Tensor, torch.Tensor]], fmt: str
) -> float:
    """The largest relative error, over the quantized layers, of each layer's output against
    the FP8 rule applied in float64 to that layer's own input in the model: where the model's
    end-to-end distance to the rule mixes in bf16 roundings between layers (which FP8
    re-rounding amplifies), this is the kernels' error alone."""
    worst = 0.0
    with torch.no_grad():
        for name, (x, y) in seen.items():
            want = Fp8RuleLinear(base.get_submodule(name), fmt)(x.double())
            worst = max(worst, float((y.double() - want).norm() / want.norm()))
    return worst


def _compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    err = got - want
    return dict(
        rel_error=float(err.norm() / want.norm()),
        max_error_over_max=float(err.abs().max() / want.abs().max()),
        argmax_agree=float((got.argmax(-1) == want.argmax(-1)).double().mean()),
    )


def measure(
    batch: int = 4, seq: int = 1024, fmt: str = "nvfp4", device: str = "cuda", modes=MODES
) -> dict[str, Any]:
    from quantdispatch import QuantLinear, load_settings
    from quantdispatch.integrations.transformers import fp8_handoff, quantize_model

    dev = torch.device(device)
    base = float_model(dev)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq), generator=g).to(dev)
    with torch.no_grad():
        want = reference(base, fmt)(ids).logits.double()
        rule = fp8_reference(base, fmt)(ids).logits.double()
        unquantized = copy.deepcopy(base).double()(ids).logits.double()
    m = batch * seq
    rows = [dict(mode="bf16 weights (not quantized)", m=m, kernels=["cuBLAS"],
                 finite=True, **_compare(unquantized, want))]  # fmt: skip
    for mode in modes:
        settings = load_settings({}, fp8_compute=mode)
        model = quantize_model(copy.deepcopy(base), fmt, settings=settings)
        layers = {n: x for n, x in model.named_modules() if isinstance(x, QuantLinear)}
        seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        hooks = [x.register_forward_hook(_recorder(seen, n)) for n, x in layers.items()]
        fp8_handoff.clear()
        with torch.no_grad():
            got = model(ids).logits.double()
        shared = fp8_handoff.counts()
        for h in hooks:
            h.remove()
        row = dict(mode=mode, m=m, producers=_producers(model), **shared)
        row["kernels"] = sorted({x.decision.kernel_for(m).family for x in layers.values()})
        row.update(_compare(got, want), finite=bool(torch.isfinite(got).all()))
        row["rel_error_vs_fp8_rule"] = float((got - rule).norm() / rule.norm())
        row["layer_rel_error_vs_fp8_rule"] = _layers_vs_rule(base, seen, fmt)
        rows.append(row)
        del model
    return dict(config=CONFIG, batch=batch, seq=seq, format=fmt, rows=rows)


def render(report: dict[str, Any]) -> str:
    lines = [
        f"# FP8 compute, whole-model logits ({report['format']}, {report['device']})",
        "",
        f"Llama-style model {report['config']}, random bf16 weights; one prefill of "
        f"{report['batch']} x {report['seq']} tokens; reference: float64 model with the "
        f"dequantized weights (W4A16). {report['date']}, torch {report['torch']}.",
        "",
        "| fp8_compute | kernel at M | rel. error vs W4A16 | max err / max logit | arg-max agrees "
        "| model vs FP8 rule | worst layer vs FP8 rule | FP8 producers "
        "| codes shared / quantized |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['mode']} | {', '.join(r['kernels'])} | {r['rel_error']:.2e} | "
            f"{r['max_error_over_max']:.2e} | {100 * r['argmax_agree']:.1f}% | "
            + (f"{r['rel_error_vs_fp8_rule']:.2e} |" if "rel_error_vs_fp8_rule" in r else "|")
            + (
                f" {r['layer_rel_error_vs_fp8_rule']:.2e} |"
                if "rel_error_vs_fp8_rule" in r
                else " |"
            )
            + (f" {r['producers']} | {r['hits']} / {r['misses']} |" if "producers" in r else " | |")
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    report = measure(args.batch, args.seq, args.format)
    now = dt.datetime.now(dt.UTC)
    report.update(
        device=torch.cuda.get_device_name(), date=now.isoformat(timespec="seconds"),
        torch=torch.__version__,
    )  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"fp8-logits-{args.format}-h200-{now:%Y-%m-%d}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    stem.with_suffix(".md").write_text(render(report), encoding="utf-8")
    print(render(report))


if __name__ == "__main__":
    main()
