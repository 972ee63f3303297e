#!/usr/bin/env python3
"""Whole HF models as a user runs them: quantized (``quantize_model``) against bf16, and
against bf16 with the same fused norms / activations, on one GPU, in one run.

Models (random weights, real shapes, transformers' own classes, sdpa attention):
``llama-3-8b`` (32 layers) and ``qwen3-30b-a3b`` (48 layers, 128 experts, top-8); ``--layers``
cuts depth for quick runs. Variants: ``bf16`` (HF as it is), ``bf16-fused``
(``install_fused_ops``), ``quant`` (quantized with ``--format``, fused ops on, as
``quantize_model`` leaves it) and the diagnostic ``quant-plain`` (fused ops removed). Two model
objects hold them: the quantized one, built and quantized first, and a bf16 one from the same
seed; the fused ops are switched on and off between rounds.

Runs, each per variant:

- ``eager-decode``: the one-token decode step (forward on a StaticCache + greedy arg-max, what
  ``generate`` runs per token, without its bookkeeping) run eagerly, ms per step;
- ``graph-decode``: the same step captured in a CUDA graph (``capture_decode``), ms per replay;
  its greedy tokens are checked against the eager step's;
- ``compiled-decode``: transformers' ``generate`` with ``torch.compile`` (CompileConfig with
  dynamo's ``cudagraphs`` backend: the step traced once, replayed as a CUDA graph), ms per token
  from t(N) - t(1);
- ``eager-prefill``: one forward over a prompt of ``tokens`` (logits of the last position).

Decode runs start from a 128-token prompt; each round prefills, synchronizes, then times
``--steps`` steps (so a host-bound prefill never hides the steps' GPU time). Every time is a
median of ``--reps`` rounds with the device synchronized at both ends, and each round runs every
variant once (round-robin after a warm-up round), so that slow phases of the host, which eager
runs feel most, hit every variant alike (compiled generate runs one variant after the other).
Writes ``whole-model-<gpu>-<date>.json``: ``rows`` with keys
``model``, ``run``, ``batch``, ``tokens``, ``bf16_ms``, ``bf16_fused_ms``, ``quant_ms``,
``format`` (and ``tokens_match_eager`` for graph decode), plus versions, settings and per model
``quantize_s`` and ``first_token_s`` (the cold time to first token is their sum); and a
markdown table beside it. Results are written after every row; ``--budget-s`` skips what would
start later (recorded as skipped).

    PYTHONPATH=$PWD python3 benchmarks/whole_model.py [--models llama-3-8b] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3-8b": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False)),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)),
    "tiny": ("LlamaConfig", dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=512)),
}  # fmt: skip
RUNS = ("eager-decode", "graph-decode", "compiled-decode", "eager-prefill")
#: Variant -> its row key. ``quant-plain`` is a diagnostic: the quantized model without fused ops.
VARIANTS = {"bf16": "bf16_ms", "bf16-fused": "bf16_fused_ms", "quant": "quant_ms",
            "quant-plain": "quant_plain_ms"}  # fmt: skip
PROMPT = 128


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-3-8b,qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=None, help="cut every model to this depth")
    p.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4", "fp8"])
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--compiled-batches", default="1", help="batches of compiled-decode")
    p.add_argument("--prefill", default="512,1024,4096")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per round")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument(
        "--variants", default="bf16,bf16-fused,quant",
        help="which of bf16, bf16-fused, quant, quant-plain (quantized, fused ops removed) to "
             "run, in this order",
    )  # fmt: skip
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    a.models = [m for m in a.models.split(",") if m]
    a.variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; valid: {', '.join(VARIANTS)}")
    a.runs = [r for r in a.runs.split(",") if r]
    for name, got, valid in (("--models", a.models, MODELS), ("--runs", a.runs, RUNS)):
        bad = [g for g in got if g not in valid]
        if bad:
            p.error(f"{name}: unknown {bad}; valid: {', '.join(valid)}")
    a.batches = [int(b) for b in a.batches.split(",") if b]
    a.compiled_batches = [int(b) for b in a.compiled_batches.split(",") if b]
    a.prefill = [int(t) for t in a.prefill.split(",") if t]
    return a


class Clock:
    def __init__(self, device: torch.device, budget_s: float) -> None:
        self.device, self.start, self.budget_s = device, time.perf_counter(), budget_s

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], object]) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def median_ms(self, fn: Callable[[], object], reps: int, per: int = 1) -> float:
        fn()  # warm-up: compiles, plans, allocations
        return 1e3 * statistics.median(self.time(fn) for _ in range(reps)) / per

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)


def build(name: str, layers: int | None, device: torch.device) -> Any:
    import transformers as tf

    cls, kw = MODELS[name]
    kw = dict(kw, max_position_embeddings=8192, bos_token_id=None, eos_token_id=None,
              pad_token_id=0)  # fmt: skip
    if layers is not None:
        kw["num_hidden_layers"] = layers
    cfg = getattr(tf, cls)(**kw)
    torch.manual_seed(0)
    with device:
        model = tf.AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    model.generation_config.pad_token_id = 0
    return model.eval()


class Variant:
    """One variant: a model object and whether it runs with the fused ops."""

    def __init__(self, name: str, model: Any, fused: bool) -> None:
        self.name, self.model, self.fused = name, model, fused

    def activate(self) -> None:
        from quantdispatch.integrations.transformers import install_fused_ops, remove_fused_ops

        (install_fused_ops if self.fused else remove_fused_ops)(self.model)


def _interleaved(vs: list[Variant], one: Callable[[Variant], float], reps: int) -> dict[str, float]:
    """Median ms per variant over ``reps`` rounds, each round running every variant once (round
    0 warms up and is dropped): slow phases of the host hit every variant alike."""
    times: dict[str, list[float]] = {v.name: [] for v in vs}
    for r in range(reps + 1):
        for v in vs:
            v.activate()
            t = one(v)
            if r:
                times[v.name].append(t)
    return {k: statistics.median(t) for k, t in times.items()}


def _steps_ms(dec: Any, ids: torch.Tensor, a: argparse.Namespace, clock: Clock) -> float:
    """One round: prefill (untimed, the device synchronized after it), then ms per step over
    ``a.steps`` steps."""
    dec.prefill(ids)
    clock.sync()

    def steps() -> None:
        for _ in range(a.steps):
            dec.step()

    return 1e3 * clock.time(steps) / a.steps


def eager_decode(vs: list[Variant], batch: int, a: argparse.Namespace, clock: Clock):  # type: ignore[no-untyped-def]
    from quantdispatch.integrations.transformers import capture_decode

    decs = {v.name: capture_decode(v.model, batch, PROMPT + a.steps + 8, capture=False)
            for v in vs}  # fmt: skip
    ids = _prompt(vs[0].model, batch)
    return _interleaved(vs, lambda v: _steps_ms(decs[v.name], ids, a, clock), a.reps), {}


def graph_decode(vs: list[Variant], batch: int, a: argparse.Namespace, clock: Clock):  # type: ignore[no-untyped-def]
    """Each variant's step captured with its own fused ops; greedy tokens checked against the
    same step run eagerly; then the replays timed round-robin."""
    from quantdispatch.integrations.transformers import capture_decode

    n = PROMPT + max(a.steps, 16) + 8
    ids = _prompt(vs[0].model, batch)
    decs, match = {}, {}
    for v in vs:
        v.activate()
        dec, plain = capture_decode(v.model, batch, n), capture_decode(v.model, batch, n,
                                                                      capture=False)  # fmt: skip
        match[v.name] = bool(torch.equal(dec.generate(ids, 16), plain.generate(ids, 16)))
        decs[v.name] = dec
        del plain
    ms = _interleaved(vs, lambda v: _steps_ms(decs[v.name], ids, a, clock), a.reps)
    return ms, {v: {"tokens_match_eager": m} for v, m in match.items()}


def compiled_decode(vs: list[Variant], batch: int, a: argparse.Namespace, clock: Clock):  # type: ignore[no-untyped-def]
    """transformers' compiled generate, one variant after the other (each compiles)."""
    from transformers import CompileConfig

    cc = CompileConfig(backend="cudagraphs", mode=None)
    kw = dict(do_sample=False, cache_implementation="static", compile_config=cc)
    out = {}
    for v in vs:
        v.activate()
        ids = _prompt(v.model, batch)

        def gen(n: int, model: Any = v.model, ids: torch.Tensor = ids) -> None:
            with torch.no_grad():
                model.generate(ids, max_new_tokens=n, **kw)

        gen(a.steps)  # compiles
        t_n = clock.median_ms(lambda: gen(a.steps), a.reps)
        t_1 = clock.median_ms(lambda: gen(1), a.reps)
        out[v.name] = (t_n - t_1) / (a.steps - 1)
        torch._dynamo.reset()
    return out, {}


def eager_prefill(vs: list[Variant], tokens: int, a: argparse.Namespace, clock: Clock):  # type: ignore[no-untyped-def]
    ids = _prompt(vs[0].model, 1, tokens)

    def forward(v: Variant) -> float:
        def run() -> None:
            with torch.no_grad():
                v.model(ids, use_cache=False, logits_to_keep=1)

        return 1e3 * clock.time(run)

    return _interleaved(vs, forward, a.reps), {}


def first_token(model: Any) -> None:
    """HF ``generate`` of one token from a 128-token prompt: with the quantization before it,
    the time to first token of a cold model (Triton compiles what this process has not)."""
    with torch.no_grad():
        model.generate(_prompt(model, 1), max_new_tokens=1, do_sample=False)


def _prompt(model: Any, batch: int, n: int = PROMPT) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch * 7 + n)
    return torch.randint(1, model.config.vocab_size, (batch, n), generator=g).to(model.device)


MEASURE = {"eager-decode": eager_decode, "graph-decode": graph_decode,
           "compiled-decode": compiled_decode, "eager-prefill": eager_prefill}  # fmt: skip


def measure(vs: list[Variant], a: argparse.Namespace, clock: Clock, emit) -> None:  # type: ignore[no-untyped-def]
    """Every run of every variant; ``emit(run, batch, tokens, {variant: ms}, {variant: extra})``
    per measurement."""
    plan: list[tuple[str, int, int]] = []
    for run in a.runs:
        if run == "eager-prefill":
            plan += [(run, 1, t) for t in a.prefill]
        else:
            batches = a.compiled_batches if run == "compiled-decode" else a.batches
            plan += [(run, b, a.steps) for b in batches]
    for run, batch, tokens in plan:
        if clock.left() <= 0:
            emit(run, batch, tokens, {}, {v.name: {"skipped": "time budget spent"} for v in vs})
            continue
        try:
            ms, extra = MEASURE[run](vs, tokens if run == "eager-prefill" else batch, a, clock)
        except Exception as exc:  # recorded; the other runs go on
            err = f"{type(exc).__name__}: {str(exc)[:300]}"
            ms, extra = {}, {v.name: {"error": err} for v in vs}
        emit(run, batch, tokens, ms, extra)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def variants(name: str, a: argparse.Namespace, clock: Clock, info: dict[str, Any]) -> list[Variant]:
    """The variants of one model: the quantized model is built and quantized first (its cold
    time to first token measured), then the bf16 model from the same seed (same weights), so
    that the larger bf16 copy never sits beside a second bf16 copy."""
    from quantdispatch.integrations.transformers import install_fused_ops, quantize_model

    device = torch.device(a.device)
    quant = base = None
    if any(v.startswith("quant") for v in a.variants):
        quant = build(name, a.layers, device)
        t = clock.time(lambda: quantize_model(quant, a.format, fused_ops=False))
        info["quantize_s"] = round(t, 2)
        info["quant_bytes"] = sum(b.numel() * b.element_size() for b in quant.buffers())
        info["fused_modules"] = install_fused_ops(quant)
        info["first_token_s"] = round(clock.time(lambda: first_token(quant)), 2)
    if any(v.startswith("bf16") for v in a.variants):
        base = build(name, a.layers, device)
    info["layers"] = (quant or base).config.num_hidden_layers
    models = {"bf16": (base, False), "bf16-fused": (base, True), "quant": (quant, True),
              "quant-plain": (quant, False)}  # fmt: skip
    return [Variant(v, *models[v]) for v in a.variants]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    import transformers
    import triton

    device = torch.device(a.device)
    clock = Clock(device, a.budget_s)
    now = dt.datetime.now(dt.UTC)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gpu = device_name.lower().replace(" ", "-")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"whole-model-{gpu}-{now:%Y-%m-%d}"
    report: dict[str, Any] = {
        "device": device_name, "date": now.isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "triton": triton.__version__,
                     "transformers": transformers.__version__},
        "settings": {k: v for k, v in vars(a).items() if k != "out"}, "rows": [], "models": {},
    }  # fmt: skip
    rows: dict[tuple[str, str, int, int], dict[str, Any]] = {}

    def write() -> None:
        report["rows"] = list(rows.values())
        report["elapsed_s"] = round(time.perf_counter() - clock.start, 1)
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1), encoding="utf-8")
        stem.with_suffix(".md").write_text(render(report), encoding="utf-8")

    for name in a.models:
        info = report["models"][name] = {}
        vs = variants(name, a, clock, info)

        def emit(run, batch, tokens, ms, extra, name=name, names=a.variants):  # type: ignore[no-untyped-def]
            row = rows.setdefault((name, run, batch, tokens), dict(
                model=name, run=run, batch=batch, tokens=tokens, bf16_ms=None,
                bf16_fused_ms=None, quant_ms=None, format=a.format))  # fmt: skip
            for v in names:
                key = VARIANTS[v]
                row[key] = None if ms.get(v) is None else round(ms[v], 3)
                for k, val in extra.get(v, {}).items():
                    row[k if key == "quant_ms" else f"{key[:-3]}_{k}"] = val
            print(json.dumps(row), flush=True)
            write()

        measure(vs, a, clock, emit)
        del vs
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    write()
    return report


def render(report: dict[str, Any]) -> str:
    v = report["versions"]
    lines = [
        f"# Whole models: quantized vs bf16 ({report['device']})", "",
        f"torch {v['torch']}, triton {v['triton']}, transformers {v['transformers']}; "
        f"{report['date']}. ms per decode step (eager, CUDA graph, compiled generate) or per "
        "prefill forward; speed-up = bf16 / quantized (> 1: quantized is faster).", "",
        "| model | run | batch | tokens | bf16 ms | bf16 fused ms | quant ms | vs bf16 | "
        "vs bf16 fused | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in report["rows"]:
        b, f, q = r.get("bf16_ms"), r.get("bf16_fused_ms"), r.get("quant_ms")
        note = r.get("skipped") or r.get("error") or (
            "" if "tokens_match_eager" not in r else
            ("tokens = eager" if r["tokens_match_eager"] else "tokens DIFFER")
        )  # fmt: skip
        if r.get("quant_plain_ms") is not None:
            note += f"; without fused ops {_f(r['quant_plain_ms'])} ms"
        lines.append(
            f"| {r['model']} | {r['run']} | {r['batch']} | {r['tokens']} | {_f(b)} | {_f(f)} | "
            f"{_f(q)} | {_x(b, q)} | {_x(f, q)} | {note} |"
        )
    for name, info in report.get("models", {}).items():
        if "quantize_s" in info and "first_token_s" in info:
            lines.append(
                f"\n{name}: quantize {info['quantize_s']:.2f} s + first token "
                f"{info['first_token_s']:.2f} s = cold time to first token "
                f"{info['quantize_s'] + info['first_token_s']:.2f} s."
            )
    return "\n".join(lines) + "\n"


def _f(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}"


def _x(a: float | None, b: float | None) -> str:
    return "" if not a or not b else f"{a / b:.2f}x"


if __name__ == "__main__":
    main()
