#!/usr/bin/env python3
"""Decode speed of a whole model in HF transformers: NVFP4 (``quantize_model``) vs bf16.

The model is Llama-style with real Llama-3.2-1B shapes (hidden 2048, 16 layers, intermediate
8192, 32 heads / 8 kv heads, vocab 128256, tied embeddings) and random weights. Both variants run
the same transformers settings: ``generate(do_sample=False, cache_implementation="static")``,
sdpa attention, and per ``--compile`` mode

- ``none``: eager decode steps (the Python cost of transformers' loop is in the numbers);
- ``cudagraphs``: transformers' automatic compile of the decode step with
  ``CompileConfig(backend="cudagraphs")`` (dynamo traces the step, one CUDA graph replays it:
  the same kernels as eager, without launch overhead; no inductor code generation);
- ``inductor``: transformers' default ``CompileConfig`` (inductor, mode="reduce-overhead");
  its compile takes minutes per model and batch size, so it is not in the default list;
- ``graph``: not ``generate``: the decode step an engine would run, the model's forward on a
  ``StaticCache`` for one token plus the greedy arg-max, captured once in a CUDA graph and
  replayed per token (prefill eager). No host work per token but one graph launch, and no input
  copies (dynamo's ``cudagraphs`` backend copies every parameter and buffer it does not see as
  static into its graph's inputs on each replay). Its tokens are checked against the same
  step run eagerly.

Measured per variant: model bytes on the device; time to first token (``generate`` with one
new token: prefill + first token) cold, i.e. the first call on a fresh model (the Triton kernels
of the prefill compile here) and warm (median of repeats); per batch size, decode tokens per
second = batch * (N - 1) / (t(N new tokens) - t(1 new token)), medians of repeats, after one
warm-up call that compiles the decode step, and the peak memory of that decode. The order is
bf16 first, then NVFP4 on a fresh model (same seed): the NVFP4 kernels are cold at their first
call.

Writes ``model-decode-<device>-<date>.json`` and ``.md`` under ``--out`` (versions of torch,
triton, transformers and quantdispatch, device, date, settings, every number). Results are
written after every measurement, so a run stopped by a time limit keeps what it measured;
``--budget-s`` skips what would start after that many seconds (recorded as skipped).

    PYTHONPATH=$PWD python3 benchmarks/model_decode.py [--quick] [--out DIR]
    PYTHONPATH=$PWD python3 benchmarks/model_decode.py --device cpu --quick --config tiny
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
}
COMPILE_MODES = ("none", "cudagraphs", "inductor", "graph")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (smoke run)")
    p.add_argument("--config", default="llama-3.2-1b", choices=sorted(CONFIGS))
    p.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4", "fp8"])
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128, help="N: tokens generated per call")
    p.add_argument("--reps", type=int, default=3, help="timed repeats (medians)")
    p.add_argument(
        "--compile",
        default=None,
        help="comma-separated modes from none, cudagraphs, inductor "
        "(default: none,cudagraphs,graph on a GPU, none,graph on the CPU)",
    )
    p.add_argument("--budget-s", type=float, default=420.0, help="skip steps starting later")
    p.add_argument("--quick", action="store_true", help="smoke run: short prompt/decode, 1 rep")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument(
        "--keep-compile-caches",
        action="store_true",
        help="use the existing Triton / inductor caches (default: fresh ones, so 'cold' is cold)",
    )
    args = p.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        p.error(f"--batches takes integers like 1,16 (got {args.batches!r})")
    if not args.batches or min(args.batches) < 1:
        p.error(f"--batches takes positive integers (got {args.batches!r})")
    cpu = torch.device(args.device).type == "cpu"
    modes = args.compile or ("none,graph" if cpu else "none,cudagraphs,graph")
    args.compile = [m.strip() for m in modes.split(",") if m.strip()]
    bad = [m for m in args.compile if m not in COMPILE_MODES]
    if bad:
        p.error(f"--compile takes {', '.join(COMPILE_MODES)} (got {bad})")
    if args.quick:
        args.prompt_len, args.new_tokens, args.reps = min(args.prompt_len, 16), 16, 1
        args.batches = args.batches[:1] if cpu else args.batches
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (decode speed is measured between 1 and N)")
    return args


class Clock:
    """Wall time with the device synchronized at both ends; the run's time budget."""

    def __init__(self, device: torch.device, budget_s: float) -> None:
        self.device = device
        self.start = time.perf_counter()
        self.budget_s = budget_s

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], Any]) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)


def build_model(args: argparse.Namespace, device: torch.device, seed: int = 0) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**CONFIGS[args.config], bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    model.generation_config.pad_token_id = 0
    return model.eval()


def model_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _compile_config(mode: str, device: torch.device) -> Any:
    from transformers import CompileConfig

    if mode == "none":
        return None
    # "inductor" is transformers' default CompileConfig (mode="reduce-overhead")
    cc = CompileConfig(backend="cudagraphs", mode=None) if mode == "cudagraphs" else CompileConfig()
    if device.type == "cpu":
        # transformers compiles on GPUs only; the CPU smoke run exercises the same path (the
        # cudagraphs backend then runs the traced graph without graphs)
        cc._compile_all_devices = True
    return cc


def measure(
    model: Any,
    label: str,
    args: argparse.Namespace,
    clock: Clock,
    record: Callable[[dict[str, Any]], None],
) -> None:
    """TTFT cold / warm, then decode speed per compile mode and batch size; ``record`` each."""
    device = clock.device
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_len), generator=g).to(device)
    base = dict(do_sample=False, cache_implementation="static")

    def generate(ids: torch.Tensor, n: int, mode: str) -> torch.Tensor:
        cc = _compile_config(mode, device)
        kw = dict(base, compile_config=cc) if cc is not None else dict(base, disable_compile=True)
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=n, **kw)

    entry: dict[str, Any] = {"model": label, "bytes": model_bytes(model)}
    if device.type == "cuda":
        entry["memory_allocated"] = torch.cuda.memory_allocated(device)
    entry["ttft_cold_s"] = clock.time(lambda: generate(prompt, 1, "none"))
    warm = [clock.time(lambda: generate(prompt, 1, "none")) for _ in range(max(args.reps, 2))]
    entry["ttft_warm_s"] = statistics.median(warm)
    with torch.no_grad():
        logits = model(prompt).logits
    entry["logits_finite"] = bool(torch.isfinite(logits).all())
    record({"kind": "ttft", **entry})

    for mode in args.compile:
        for batch in args.batches:
            row: dict[str, Any] = {"kind": "decode", "model": label, "compile": mode}
            row.update(batch=batch, new_tokens=args.new_tokens, prompt_len=args.prompt_len)
            if clock.left() <= 0:
                record({**row, "skipped": "time budget spent"})
                continue
            ids = prompt.repeat(batch, 1)
            if mode == "graph":
                decoder = GraphDecoder(model, batch, args.prompt_len + args.new_tokens, device)
                run_n = functools.partial(decoder, ids, args.new_tokens)
                run_1 = functools.partial(decoder, ids, 1)
            else:
                run_n = functools.partial(generate, ids, args.new_tokens, mode)
                run_1 = functools.partial(generate, ids, 1, mode)
            try:
                before = _graph_counters()
                row["warmup_s"] = clock.time(run_n)
                if mode == "graph":
                    plain = GraphDecoder(model, batch, decoder.max_len, device, capture=False)
                    same = torch.equal(decoder(ids, args.new_tokens), plain(ids, args.new_tokens))
                    row["tokens_match_eager"] = bool(same)
                elif mode != "none":
                    after = _graph_counters()
                    row["graphs"] = {k: v - before.get(k, 0) for k, v in after.items()}
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                t_n, t_1 = [], []
                for _ in range(args.reps):
                    t_1.append(clock.time(run_1))
                    t_n.append(clock.time(run_n))
                steps = statistics.median(t_n) - statistics.median(t_1)
                row["t1_s"], row["tn_s"] = statistics.median(t_1), statistics.median(t_n)
                row["decode_step_ms"] = 1e3 * steps / (args.new_tokens - 1)
                row["decode_tok_s"] = batch * (args.new_tokens - 1) / steps if steps > 0 else None
                if device.type == "cuda":
                    row["peak_memory"] = torch.cuda.max_memory_allocated(device)
            except Exception as exc:  # recorded; the other measurements go on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            record(row)


class GraphDecoder:
    """Greedy decode with the one-token step captured in a CUDA graph (the ``graph`` mode).

    ``decoder(ids, n)`` -> the n new tokens [batch, n]: an eager prefill fills the static cache
    and gives the first token; each further token is one replay of the step (forward at
    ``cache_position``, arg-max, advance). The graph is captured on the first call and reused:
    every call's prefill resets the cache. With ``capture=False`` (and on the CPU) the step runs
    eagerly: the same calls, the reference the graph's tokens are checked against."""

    def __init__(
        self, model: Any, batch: int, max_len: int, device: torch.device, capture: bool = True
    ) -> None:
        from transformers import StaticCache

        self.model, self.device, self.max_len = model, device, max_len
        self.capture = capture and device.type == "cuda"
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # positions as tensors (older transformers take cache_position, newer ones keep the
        # cache's own position counter on the device): no host sync inside the captured step
        out = self.model(
            input_ids=ids,
            past_key_values=self.cache,
            position_ids=pos.view(1, -1),
            cache_position=pos,
        )
        return out.logits[:, -1:].argmax(-1)

    def _step(self) -> None:
        self.tok.copy_(self._forward(self.tok, self.pos))
        self.pos.add_(1)

    def _prefill(self, ids: torch.Tensor) -> None:
        self.cache.reset()
        p = ids.shape[1]
        self.tok.copy_(self._forward(ids, torch.arange(p, device=self.device)))
        self.pos.fill_(p)

    def _capture(self, ids: torch.Tensor) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up off the capture: lazy allocations, autotuning
                self._step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()
        self._prefill(ids)  # the warm-up and capture advanced the cache: start again

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        self._prefill(ids)
        if self.capture and self.graph is None and n > 1:
            self._capture(ids)
        toks = [self.tok.clone()]
        for _ in range(n - 1):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
            toks.append(self.tok.clone())
        return torch.cat(toks, dim=1)


def _graph_counters() -> dict[str, Any]:
    """dynamo's counters that say whether the decode step became CUDA graphs (a skipped graph,
    e.g. for a mutated input, runs eagerly and would make the numbers eager ones)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    out = {k: int(v) for k, v in counters["inductor"].items() if "cudagraph" in k}
    out["unique_graphs"] = int(counters["stats"].get("unique_graphs", 0))
    return out


def _versions() -> dict[str, Any]:
    import transformers

    import quantdispatch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "quantdispatch": quantdispatch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def _layers_summary(model: torch.nn.Module) -> dict[str, int]:
    counts: dict[str, int] = {}
    for m in model.modules():
        backend = getattr(m, "backend", None)
        if type(m).__name__ in ("QuantLinear", "QuantMoE") and backend:
            key = f"{m.format}/{backend}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:.1f}"


def render_markdown(report: dict[str, Any]) -> str:
    v = report["versions"]
    lines = [
        f"# Model decode: {report['config']} ({report['format']} vs bf16)",
        "",
        f"{report['device']}; torch {v['torch']}, triton {v['triton']}, transformers "
        f"{v['transformers']}, quantdispatch {v['quantdispatch']}; {report['date']}",
        "",
        f"generate(do_sample=False, cache_implementation='static'), sdpa, prompt "
        f"{report['args']['prompt_len']} tokens, N = {report['args']['new_tokens']} new tokens; "
        "decode tok/s = batch x (N-1) / (t(N) - t(1)). Quantized layers: "
        + ", ".join(f"{k} x{n}" for k, n in report.get("quantized_layers", {}).items()),
        "",
        "| model | bytes (MiB) | TTFT cold (s) | TTFT warm (ms) |",
        "|---|---|---|---|",
    ]
    for r in report["rows"]:
        if r["kind"] == "ttft":
            lines.append(
                f"| {r['model']} | {_mib(r['bytes'])} | {r['ttft_cold_s']:.2f} | "
                f"{1e3 * r['ttft_warm_s']:.1f} |"
            )
    lines += [
        "",
        "| compile | batch | model | decode tok/s | ms / step | peak MiB | warm-up (s) | tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        if r["kind"] != "decode":
            continue
        if "skipped" in r or "error" in r:
            why = r.get("skipped") or r.get("error")
            lines.append(f"| {r['compile']} | {r['batch']} | {r['model']} | {why} | | | | |")
            continue
        tps = r.get("decode_tok_s")
        lines.append(
            f"| {r['compile']} | {r['batch']} | {r['model']} | "
            f"{'' if tps is None else f'{tps:.1f}'} | {r['decode_step_ms']:.2f} | "
            f"{_mib(r.get('peak_memory'))} | {r['warmup_s']:.1f} | {_tokens(r)} |"
        )
    return "\n".join(lines) + "\n"


def _tokens(row: dict[str, Any]) -> str:
    """The graph mode's check: its greedy tokens against eager generate's."""
    if "tokens_match_eager" not in row:
        return ""
    return "= eager" if row["tokens_match_eager"] else "DIFFER from eager"


def _fresh_compile_caches() -> dict[str, str]:
    """Point Triton's and inductor's caches at new folders (before anything compiles) unless the
    user set them: kernels compiled by an earlier run would make the cold TTFT a warm one."""
    out = {}
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        if var not in os.environ:
            os.environ[var] = tempfile.mkdtemp(prefix=var.lower() + "-")
        out[var] = os.environ[var]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    caches = {} if args.keep_compile_caches else _fresh_compile_caches()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    clock = Clock(device, args.budget_s)
    from quantdispatch.integrations.transformers import quantize_model

    now = dt.datetime.now(dt.UTC)
    slug = _device_name(device).split("(")[0].strip().replace(" ", "-").lower() or "device"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"model-decode-{slug}-{now:%Y-%m-%d}"
    report: dict[str, Any] = {
        "config": args.config,
        "format": args.format,
        "device": _device_name(device),
        "date": now.isoformat(timespec="seconds"),
        "versions": _versions(),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "shapes": CONFIGS[args.config],
        "compile_caches": caches,
        "rows": [],
    }

    def record(row: dict[str, Any]) -> None:
        report["rows"].append(row)
        report["elapsed_s"] = round(time.perf_counter() - clock.start, 1)
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1), encoding="utf-8")
        stem.with_suffix(".md").write_text(render_markdown(report), encoding="utf-8")
        print(json.dumps(row), flush=True)

    model = build_model(args, device)
    measure(model, "bf16", args, clock, record)
    del model
    gc.collect()
    if device.type == "cuda":
        torch._dynamo.reset()
        torch.cuda.empty_cache()

    model = build_model(args, device)
    t_q = clock.time(lambda: quantize_model(model, args.format))
    report["quantize_s"] = round(t_q, 2)
    report["quantized_layers"] = _layers_summary(model)
    measure(model, args.format, args, clock, record)
    print(f"wrote {stem}.json and .md", flush=True)
    return report


if __name__ == "__main__":
    main()
