"""``quantdispatch doctor`` (what runs here and why) and ``quantdispatch presets``.

The doctor asks the resolver for a decision per (format, op, activation dtype) and each decision
for the kernel family it runs at each M (``Decision.kernel_ranges``); it never imports kernels.
``--shape`` / ``--moe`` give those decisions a layer's shape, ``--tp`` each rank's shard of it
(the split rules of quantdispatch.checkpoints): quantdispatch.cli.report collects, cli.text
prints.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

from quantdispatch import __version__
from quantdispatch.cli.common import ACT_DTYPE_NAMES, EXIT_DECISION, EXIT_OK, OPS
from quantdispatch.cli.report import Answer, Row, collect, to_json
from quantdispatch.cli.text import (
    Header,
    concise,
    error_line,
    fp8_line,
    marlin_lines,
    pdl_applies,
    selfcheck_lines,
    shard_label,
)
from quantdispatch.errors import (
    ConfigurationError,
    QuantDispatchError,
    WeightFormatError,
    format_error,
)

__all__ = ["run_doctor", "run_presets", "verbose"]


def run_doctor(args: argparse.Namespace) -> int:
    from quantdispatch.api import current_settings
    from quantdispatch.device import device_profile
    from quantdispatch.formats import FORMATS, get_format
    from quantdispatch.policy import load_policy

    settings = current_settings()
    policy = load_policy(args.policy if args.policy else settings.policy)
    formats = [get_format(f).name for f in args.formats] if args.formats else list(FORMATS)
    ops = args.ops or list(OPS)
    dtypes = args.act_dtypes or list(ACT_DTYPE_NAMES)
    if args.matrix:
        from quantdispatch.cli.matrix import run_matrix

        return run_matrix(formats, ops, dtypes, args.scheme, settings, policy, as_json=args.json)

    if args.model:
        return _model(args, settings, policy)
    device_by = "--device" if args.device else "QUANTDISPATCH_DEVICE"
    profile = device_profile(args.device if args.device else settings.device)
    rows = collect(args, formats, ops, dtypes, profile, settings, policy)
    if args.json:
        print(json.dumps(to_json(rows, profile, settings, policy), indent=2))
    else:
        view = Header(profile, settings, policy, device_by)
        lines = verbose(view, rows, args.tp) if args.verbose else concise(view, rows, args.tp)
        print("\n".join(lines))
    errors = [error_line(r) for r in rows if r.answer.error]
    errors += [f"{r.fmt} over {args.tp} ranks: {r.shard_error}" for r in rows if r.shard_error]
    if errors:
        print(f"quantdispatch: error: {errors[0]}", file=sys.stderr)
        return EXIT_DECISION
    return EXIT_OK


#: What reading a damaged checkpoint folder raises where the readers do not say it in our words.
_UNREADABLE = (
    OSError, ValueError, OverflowError, MemoryError, KeyError, TypeError, AttributeError,
    struct.error,
)  # fmt: skip


def _model(args: argparse.Namespace, settings: object, policy: object) -> int:
    """``doctor --model PATH``: the checkpoint's quantized layer kinds and their decisions. A
    folder that is not a readable checkpoint is a usage error (exit 2), one line."""
    from quantdispatch.integrations.transformers import describe_model, render_description
    from quantdispatch.request import parse_act_dtype

    device = args.device if args.device else getattr(settings, "device", None)
    act = parse_act_dtype((args.act_dtypes or ["bf16"])[0])
    folder = Path(args.model)
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        raise ConfigurationError(
            format_error(
                f"--model {args.model!r} {what}",
                "--model takes a checkpoint folder (config.json and *.safetensors files)",
                "pass the folder that holds them",
            )
        )
    try:
        d = describe_model(folder, device, act_dtype=act, policy=policy, settings=settings)
    except WeightFormatError as exc:  # CheckpointError included: the folder, not a decision
        raise ConfigurationError(f"--model {args.model!r}: {exc}") from None
    except _UNREADABLE as exc:
        if isinstance(exc, QuantDispatchError):
            raise
        raise ConfigurationError(
            format_error(
                f"--model {args.model!r} cannot be read: {type(exc).__name__}: {exc}",
                "a checkpoint folder holds a JSON config.json and safetensors files",
                "check that the folder holds a complete checkpoint",
            )
        ) from None
    print(
        json.dumps(d, indent=2, default=str)
        if args.json
        else render_description(d, verbose=args.verbose)
    )
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# --verbose: every probe's source, every candidate's whole reason, every range's detail


def verbose(h: Header, rows: list[Row], tp: int | None = None) -> list[str]:
    from quantdispatch.backends import backend_names

    lines = _verbose_header(h)
    lines.append("Self-check on first use (QUANTDISPATCH_SELF_CHECK)")
    lines += [f"  {x}" for x in selfcheck_lines(h.profile, backend_names())]
    lines += ["", "Decisions (-> chosen; 'no' rejected; 'ok' could also run)"]
    for row in rows:
        a = row.answer
        if a.decision is None:
            lines += [f"{row.fmt} {row.op} ({row.dt}) on {h.profile.label()}"]
            lines += [f"  -> ERROR: {a.error}", ""]
            continue
        lines.append(a.decision.explain())
        if row.shape is not None:
            n, k = row.shape
            if row.experts:
                lines.append(
                    f"  MoE layer: {row.experts} experts, top-{row.top_k}, hidden {k}, "
                    f"intermediate {n}, on {a.decision.backend}:"
                )
            else:
                lines.append(f"  N={n} K={k} on {a.decision.backend}:")
            lines += _verbose_ranges(a, row, "    ")
            lines += _resident_line(a.decision, row)
        for s in row.shards:
            d = s.answer.decision
            where = f"  {shard_label(s, tp)}: "
            if d is None:
                lines.append(where + f"ERROR: {s.answer.error}")
                continue
            lines.append(where + f"-> {d.backend}: {d.reason}")
            lines += _verbose_ranges(s.answer, row, "    ")
        if row.shard_error:
            lines.append(f"  TP {tp}: cannot split: {row.shard_error}")
        lines.append("")
    return lines


def _resident_line(d, row: Row) -> list[str]:
    """What FP8 compute's resident copy of this linear's weight takes, where it can have one."""
    if row.experts:
        return []
    size = d.option_facts().get("fp8_resident_bytes")
    if size is None:
        return []
    n, k = row.shape
    kept = d.options_dict().get("fp8_compute") == "prefill-resident"
    used = "kept" if kept else "with fp8_compute=prefill-resident"
    return [
        f"  resident FP8 copy ({used}): {size / 1e6:.1f} MB on top of the FP4 weight's "
        f"{n * k / 2e6:.1f} MB"
    ]


def _verbose_ranges(a: Answer, row: Row, indent: str) -> list[str]:
    if a.ranges_error:
        return [f"{indent}{a.ranges_error}"]
    out = []
    for r in a.ranges:
        lo, hi = r.first_m, r.last_m
        span = r.span()
        words = f"{r.family} ({r.detail})" if r.detail else r.family
        if row.experts and row.top_k:  # 6 significant digits: 1023.88, not 1.02e+03
            share = row.top_k / row.experts
            tpe = f"{lo * share:.6g}+" if hi is None else f"{lo * share:.6g}"
            if hi is not None and hi != lo:
                tpe += f"..{hi * share:.6g}"
            out.append(f"{indent}{span} ({tpe} tokens per expert): {r.detail or r.family}")
        else:
            out.append(f"{indent}{span}: {words}")
    return out


def _verbose_header(h: Header) -> list[str]:
    profile, settings, policy = h.profile, h.settings, h.policy
    src = profile.sources
    gib = f"{profile.memory_bytes / 2**30:.1f} GiB" if profile.memory_bytes else "-"
    rows = [
        ("device", profile.name, src.name.value),
        ("compute capability", profile.sm, src.capability.value),
        ("SMs", str(profile.sm_count or "-"), src.sm_count.value),
        ("memory", gib, src.memory_bytes.value),
        ("driver", profile.driver_version or "-", src.driver_version.value),
        ("torch", profile.torch_version, "torch"),
        ("torch CUDA build", profile.cuda_version or "none", src.cuda_version.value),
        ("torch can launch kernels", "yes" if profile.torch_cuda else "no", src.torch_cuda.value),
    ]
    lines = [f"quantdispatch {__version__} doctor", ""]
    if profile.kind == "cpu" and "no GPU found" in profile.notes:
        lines.append("No GPU found: decisions below are for this CPU.")
    if profile.simulated:
        lines.append(f"SIMULATED device (preset {profile.preset!r}): explains only, runs nothing.")
    lines.append("Device")
    for label, value, source in rows:
        lines.append(f"  {label:<26}{value:<40}[{source}]")
    for note in profile.notes:
        lines.append(f"  note: {note}")
    lines += ["", "Kernel providers"]
    for p in profile.providers:
        if p.available:
            lines.append(f"  {p.name:<12}{p.version or '(version unknown)'}")
        else:
            lines.append(f"  {p.name:<12}not importable: {p.reason}  [{p.install_hint}]")
    lines += [f"  {'marlin':<12}{m}" for m in marlin_lines()]
    s = settings.describe()
    forced = ", ".join(f"{f}={v['backend']} ({v['by']})" for f, v in s["forced"].items()) or "none"
    simulated = f"preset {profile.preset!r} ({h.device_by})" if profile.simulated else None
    lines += [
        "",
        "Settings",
        f"  forced backends           {forced}",
        f"  disabled backends         {', '.join(s['disabled']) or 'none'}",
        f"  policy                    {' + '.join(policy.sources)}",
        f"  simulated device          {simulated or 'none (probed)'}",
        f"  FP8 compute (lossy)       {fp8_line(settings, policy, verbose=True)}",
    ]
    if pdl_applies(profile):
        lines.append(
            "  dependent launches        "
            + (
                "on: the single-pair MoE down kernel starts while gate/up runs, the mid-M GEMM "
                "and its split sum while the kernel before them ends (QUANTDISPATCH_PDL=0 "
                "turns it off)"
                if s["pdl"]
                else "off (QUANTDISPATCH_PDL)"
            )
        )
    return [*lines, ""]


# ---------------------------------------------------------------------------------------------
# presets, --matrix


def run_presets() -> int:
    from quantdispatch.device import PRESETS

    print(f"{'preset':<12} {'SM':<5} {'SMs':>4} {'GiB':>5}  name")
    for key, p in PRESETS.items():
        sm = f"{p.capability[0]}.{p.capability[1]}" if p.capability else "-"
        sms = str(p.sm_count) if p.sm_count else "-"
        gib = f"{p.memory_gib:g}" if p.memory_gib else "-"
        print(f"{key:<12} {sm:<5} {sms:>4} {gib:>5}  {p.name}")
    return EXIT_OK
