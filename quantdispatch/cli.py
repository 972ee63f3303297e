"""``quantdispatch`` command line: ``doctor`` (what runs here and why), ``presets``, ``verify``.

Exit codes: 0 success; 1 a decision could not be made (e.g. a forced backend cannot run) or a
verification failed; 2 bad flags, env values or policy files. Errors are one line on stderr,
never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from quantdispatch.errors import ConfigurationError, QuantDispatchError

__all__ = ["main"]

EXIT_OK, EXIT_DECISION, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage dump
        print(
            f"quantdispatch: error: {message} (see quantdispatch {self._cmd()} --help)",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_USAGE)

    def _cmd(self) -> str:
        return self.prog.split(" ", 1)[1] if " " in self.prog else ""


def _build_parser() -> argparse.ArgumentParser:
    from quantdispatch.request import ACT_DTYPES, Op, Scheme

    parser = _Parser(
        prog="quantdispatch",
        description="Which kernel runs each quantized format on this GPU, and why.",
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    doc = sub.add_parser("doctor", help="explain the device and every decision")
    doc.add_argument("--device", help="simulate a preset GPU (see 'quantdispatch presets')")
    doc.add_argument(
        "--format",
        action="append",
        dest="formats",
        metavar="F",
        help="format(s) to explain (default: all); repeatable",
    )
    doc.add_argument(
        "--op",
        action="append",
        dest="ops",
        choices=[o.value for o in Op],
        help="op(s) to explain (default: all); repeatable",
    )
    doc.add_argument(
        "--act-dtype",
        action="append",
        dest="act_dtypes",
        choices=list(ACT_DTYPES),
        help="activation dtype(s) (default: bf16 and fp16); repeatable",
    )
    doc.add_argument(
        "--scheme",
        choices=[s.value for s in Scheme],
        help="checkpoint scheme (default: each format's usual one)",
    )
    doc.add_argument(
        "--shape",
        type=_weight_shape,
        metavar="NxK",
        help="one linear layer's weight, N output rows x K input columns (e.g. 6144x4096): "
        "its decisions and the kernel for each M range (default: the rules by weight size)",
    )
    doc.add_argument(
        "--moe",
        type=_moe_shape,
        metavar="E,TOPK,H,I",
        help="one MoE layer: experts, top-k, hidden and intermediate size (e.g. "
        "128,8,2048,768): the kernel the triton backend runs its NVFP4 / MXFP4 experts on for "
        "each M range",
    )
    doc.add_argument("--policy", help="policy TOML file laid over the default")
    doc.add_argument("--json", action="store_true", help="one JSON object on stdout")
    doc.add_argument(
        "--matrix", action="store_true", help="chosen backend for every preset x format x op"
    )
    sub.add_parser("presets", help="list the GPU presets --device accepts")
    ver = sub.add_parser("verify", help="run every runnable backend here against the reference")
    ver.add_argument("--format", action="append", dest="formats", metavar="F")
    ver.add_argument("--json", action="store_true")
    return parser


def _weight_shape(text: str) -> tuple[int, int]:
    """``--shape NxK`` -> (N, K), positive integers."""
    n, sep, k = text.lower().partition("x")
    if not sep or not n.strip().isdigit() or not k.strip().isdigit() or 0 in (int(n), int(k)):
        raise argparse.ArgumentTypeError(
            f"--shape {text!r}: expected NxK, two positive integers (the weight's output rows "
            "and input columns), e.g. --shape 6144x4096"
        )
    return int(n), int(k)


def main(argv: Sequence[str] | None = None) -> int:
    # torch warns when it is imported without numpy (a fresh `pip install quantdispatch` has
    # none); nothing here uses numpy, so that warning should not be the doctor's first line
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "doctor":
            return _doctor(args)
        if args.command == "presets":
            return _presets()
        if args.command == "verify":
            from quantdispatch.verify import run_verify

            return run_verify(args.formats, as_json=args.json)
        parser.print_help()
        return EXIT_USAGE
    except ConfigurationError as exc:
        print(f"quantdispatch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except QuantDispatchError as exc:
        print(f"quantdispatch: error: {exc}", file=sys.stderr)
        return EXIT_DECISION


# ---------------------------------------------------------------------------------------------


def _presets() -> int:
    from quantdispatch.device import PRESETS

    print(f"{'preset':<12} {'SM':<5} {'SMs':>4} {'GiB':>5}  name")
    for key, p in PRESETS.items():
        sm = f"{p.capability[0]}.{p.capability[1]}" if p.capability else "-"
        sms = str(p.sm_count) if p.sm_count else "-"
        gib = f"{p.memory_gib:g}" if p.memory_gib else "-"
        print(f"{key:<12} {sm:<5} {sms:>4} {gib:>5}  {p.name}")
    return EXIT_OK


def _profile_dict(profile: Any) -> dict[str, Any]:
    data = profile.model_dump(mode="json", exclude={"providers"})
    return data


def _moe_shape(text: str) -> tuple[int, int, int, int]:
    """``--moe E,TOPK,H,I`` -> (E, TOPK, H, I), positive integers, TOPK <= E."""
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"--moe {text!r}: expected E,TOPK,H,I, four positive integers (experts, experts "
            "per token, hidden size, intermediate size), e.g. --moe 128,8,2048,768"
        )
    e, k, h, i = (int(p) for p in parts)
    if k > e:
        raise argparse.ArgumentTypeError(
            f"--moe {text!r}: top-k {k} is more than the {e} experts; give TOPK <= E"
        )
    return e, k, h, i


def _moe_layer(shape: tuple[int, int, int, int], profile: Any) -> dict:
    """The triton backend's kernels for one MoE layer's NVFP4 / MXFP4 experts by M (doctor
    --moe): the ranges come from the same plan QuantMoE runs, for this GPU (a simulated one:
    from its compute capability)."""
    e, k, h, i = shape
    capability = profile.capability
    out: dict[str, Any] = {"experts": e, "top_k": k, "hidden": h, "intermediate": i}

    def unrepacked(note: str) -> dict:
        return {**out, "note": note, "ranges": []}

    if capability is None or capability < (8, 0):
        return unrepacked(
            "the experts keep the checkpoint layout and run the fused tl.dot kernels (the "
            "mma.sync kernels on repacked experts need SM 8.0+)"
        )
    if h % 64 or i % 64:
        return unrepacked(
            f"H={h} and I={i} must both be multiples of 64 to repack the experts: they keep "
            "the checkpoint layout and run the fused tl.dot kernels"
        )
    try:
        from quantdispatch.kernels.mma_layout.moe_plan import MoeDeviceFacts, moe_kernel_ranges
    except ImportError as exc:  # no triton: no kernels to name
        return unrepacked(f"the kernels cannot be named here: {exc}")
    if profile.kind == "cuda" and not profile.simulated and profile.torch_cuda:
        import torch

        facts = MoeDeviceFacts.of(torch.device("cuda", profile.index or 0))
    else:
        facts = MoeDeviceFacts.for_capability(capability)
    out["note"] = (
        "gated experts, repacked once (mma16x64, same bytes; MXFP4 experts whose block scales "
        "span <= 18 binades, the others keep the checkpoint layout)"
    )
    out["ranges"] = [
        {"m_min": lo, "m_max": hi, "tokens_per_expert": [lo * k / e, hi * k / e], "kernel": w}
        for lo, hi, w in moe_kernel_ranges(k, e, i, h, facts)
    ]
    out["ranges"][-1]["m_max"] = None  # the last range goes on
    out["ranges"][-1]["tokens_per_expert"][1] = None
    return out


def _moe_layer_text(layer: dict, label: str) -> str:
    lines = [
        f"MoE layer: {layer['experts']} experts, top-{layer['top_k']}, hidden "
        f"{layer['hidden']}, intermediate {layer['intermediate']}, NVFP4 / MXFP4 experts on "
        f"the triton backend, {label}",
        f"  {layer['note']}",
    ]
    for r in layer["ranges"]:
        lo, hi = r["m_min"], r["m_max"]
        span = f"M >= {lo}" if hi is None else (f"M = {lo}" if lo == hi else f"M {lo}..{hi}")
        tpe_lo, tpe_hi = r["tokens_per_expert"]  # 6 significant digits: 1023.88, not 1.02e+03
        if hi is None:
            tpe = f"{tpe_lo:.6g}+"
        else:
            tpe = f"{tpe_lo:.6g}" + ("" if lo == hi else f"..{tpe_hi:.6g}")
        lines.append(f"  {span} ({tpe} tokens per expert): {r['kernel']}")
    return "\n".join(lines)


def _doctor(args: argparse.Namespace) -> int:
    from quantdispatch.api import current_settings, select
    from quantdispatch.device import device_profile
    from quantdispatch.formats import FORMATS, get_format
    from quantdispatch.policy import load_policy
    from quantdispatch.request import ACT_DTYPES, Op

    settings = current_settings()
    policy = load_policy(args.policy if args.policy else settings.policy)
    formats = [get_format(f).name for f in args.formats] if args.formats else list(FORMATS)
    ops = args.ops or [o.value for o in Op]
    dtypes = args.act_dtypes or list(ACT_DTYPES)

    if args.matrix:
        return _matrix(formats, ops, dtypes, args.scheme, settings, policy, as_json=args.json)

    device = args.device if args.device else settings.device
    profile = device_profile(device)
    decisions: list[dict[str, Any]] = []
    blocks: list[str] = []
    errors: list[str] = []
    for fmt in formats:
        for op in ops:
            for dt in dtypes:
                n, k = args.shape if args.shape and op == Op.LINEAR.value else (None, None)
                try:
                    d = select(
                        fmt, op, dt, args.scheme, n=n, k=k, device=profile, settings=settings,
                        policy=policy,
                    )  # fmt: skip
                except QuantDispatchError as exc:
                    if isinstance(exc, ConfigurationError):
                        raise
                    errors.append(str(exc))
                    decisions.append(
                        {
                            "format": fmt,
                            "op": op,
                            "act_dtype": dt,
                            "backend": None,
                            "reason": None,
                            "error": str(exc),
                            "trace": [],
                        }
                    )
                    blocks.append(f"{fmt} {op} ({dt}) on {profile.label()}\n  -> ERROR: {exc}")
                    continue
                decisions.append(d.to_dict())
                blocks.append(d.explain())

    moe_layer = _moe_layer(args.moe, profile) if args.moe else None
    if args.json:
        out = {
            "quantdispatch": _version(),
            "device": _profile_dict(profile),
            "providers": [p.model_dump(mode="json") for p in profile.providers],
            "settings": {**settings.describe(), "policy_files": list(policy.sources)},
            "decisions": decisions,
        }
        if moe_layer is not None:
            out["moe_layer"] = moe_layer
        print(json.dumps(out, indent=2))
    else:
        print(_human_header(profile, settings, policy))
        print("Decisions (-> chosen; 'no' rejected; 'ok' could also run)")
        for b in blocks:
            print(b)
            print()
        if moe_layer is not None:
            print(_moe_layer_text(moe_layer, profile.label()))
            print()
    if errors:
        print(f"quantdispatch: error: {errors[0]}", file=sys.stderr)
        return EXIT_DECISION
    return EXIT_OK


def _version() -> str:
    from quantdispatch import __version__

    return __version__


def _human_header(profile: Any, settings: Any, policy: Any) -> str:
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
    lines = [f"quantdispatch {_version()} doctor", ""]
    if profile.kind == "cpu" and not profile.simulated:
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
    s = settings.describe()
    forced = ", ".join(f"{f}={v['backend']} ({v['by']})" for f, v in s["forced"].items()) or "none"
    lines += [
        "",
        "Settings",
        f"  forced backends           {forced}",
        f"  disabled backends         {', '.join(s['disabled']) or 'none'}",
        f"  policy                    {' + '.join(policy.sources)}",
        f"  simulated device          {s['device'] or 'none (probed)'}",
        "  dependent launches        "
        + (
            "on: on SM 9.0+ the single-pair MoE down kernel starts while gate/up runs, the "
            "mid-M GEMM and its split sum while the kernel before them ends "
            "(QUANTDISPATCH_PDL=0 turns it off)"
            if s["pdl"]
            else "off (QUANTDISPATCH_PDL)"
        ),
        "",
    ]
    return "\n".join(lines)


def _matrix(
    formats: list[str],
    ops: list[str],
    dtypes: list[str],
    scheme: str | None,
    settings: Any,
    policy: Any,
    *,
    as_json: bool,
) -> int:
    from quantdispatch.api import select
    from quantdispatch.device import PRESETS, preset_profile

    columns = [(f, o, d) for f in formats for o in ops for d in dtypes]
    table: dict[str, dict[str, str]] = {}
    failed = False
    for key in PRESETS:
        profile = preset_profile(key)
        row = {}
        for f, o, d in columns:
            try:
                row[f"{f}/{o}/{d}"] = select(
                    f, o, d, scheme, device=profile, settings=settings, policy=policy
                ).backend
            except ConfigurationError:
                raise
            except QuantDispatchError:
                row[f"{f}/{o}/{d}"] = "ERROR"
                failed = True
        table[key] = row
    if as_json:
        print(json.dumps({"quantdispatch": _version(), "matrix": table}, indent=2))
    else:
        names = [f"{f}/{o}/{d}" for f, o, d in columns]
        width = max(9, *(len(n) for n in names))
        print("preset      SM    " + " ".join(f"{n:<{width}}" for n in names))
        for key, row in table.items():
            p = PRESETS[key]
            sm = f"{p.capability[0]}.{p.capability[1]}" if p.capability else "-"
            print(f"{key:<11} {sm:<5} " + " ".join(f"{row[n]:<{width}}" for n in names))
    return EXIT_DECISION if failed else EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
