"""The ``quantdispatch`` argument parser and the dispatch to its commands.

This module imports nothing heavy (no torch, no backends): ``--help`` and ``--version`` answer
at once, and each command imports what it needs only when it runs.

Exit codes: quantdispatch.cli.common. Errors are one line on stderr, never a traceback; a
closed stdout (``| head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from quantdispatch import __version__
from quantdispatch.cli.common import (
    ACT_DTYPE_NAMES,
    EXIT_DECISION,
    EXIT_OK,
    EXIT_USAGE,
    OPS,
    SCHEMES,
)
from quantdispatch.errors import ConfigurationError, QuantDispatchError

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    commands: dict[str, argparse.ArgumentParser]  # the top-level parser's subcommand parsers

    def error(self, message: str) -> NoReturn:  # one line, no usage dump
        hint = " ".join(p for p in ("quantdispatch", self._cmd(), "--help") if p)
        print(f"quantdispatch: error: {message} (see {hint})", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)

    def _cmd(self) -> str:
        return self.prog.split(" ", 1)[1] if " " in self.prog else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="quantdispatch",
        description="Which kernel runs each quantized format on this GPU, and why.",
    )
    parser.add_argument("--version", action="version", version=f"quantdispatch {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    doc = sub.add_parser("doctor", help="explain the device and every decision")
    _doctor_arguments(doc)
    pre = sub.add_parser("presets", help="list the GPU presets --device accepts")
    ver = sub.add_parser("verify", help="run every runnable backend here against the reference")
    ver.add_argument("--format", action="append", dest="formats", metavar="F")
    ver.add_argument("--json", action="store_true")
    ver.add_argument(
        "--fp8-compute",
        action="store_true",
        help="also check FP8 compute (lossy; both modes), in its own section with its own "
        "bounds (default: only when QUANTDISPATCH_FP8_COMPUTE or the policy turns it on)",
    )
    parser.commands = {"doctor": doc, "presets": pre, "verify": ver}
    return parser


def _doctor_arguments(doc: argparse.ArgumentParser) -> None:
    """``doctor``'s options."""
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
        choices=OPS,
        help="op(s) to explain (default: all); repeatable",
    )
    doc.add_argument(
        "--act-dtype",
        action="append",
        dest="act_dtypes",
        choices=ACT_DTYPE_NAMES,
        help="activation dtype(s) (default: bf16 and fp16); repeatable",
    )
    doc.add_argument(
        "--scheme", choices=SCHEMES, help="checkpoint scheme (default: each format's usual one)"
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
        "128,8,2048,768): its decisions and the kernel for each M range",
    )
    doc.add_argument(
        "--tp",
        type=_tp_size,
        metavar="N",
        help="with --shape: each rank's column- and row-parallel shard; with --moe: each "
        "rank's intermediate size (tensor parallel over N ranks)",
    )
    doc.add_argument(
        "--model",
        metavar="PATH",
        help="a checkpoint folder (config.json + safetensors): its quantized layer kinds and the "
        "backend and kernels each runs on this GPU (or --device)",
    )
    doc.add_argument("--policy", help="policy TOML file laid over the default")
    doc.add_argument("--json", action="store_true", help="one JSON object on stdout")
    doc.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="the full text: every probe's source, every candidate's whole reason",
    )
    doc.add_argument(
        "--matrix", action="store_true", help="chosen backend for every preset x format x op"
    )


def _weight_shape(text: str) -> tuple[int, int]:
    """``--shape NxK`` -> (N, K), positive integers."""
    n, sep, k = text.lower().partition("x")
    if not sep or not n.strip().isdigit() or not k.strip().isdigit() or 0 in (int(n), int(k)):
        raise argparse.ArgumentTypeError(
            f"--shape {text!r}: expected NxK, two positive integers (the weight's output rows "
            "and input columns), e.g. --shape 6144x4096"
        )
    return int(n), int(k)


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


def _tp_size(text: str) -> int:
    """``--tp N`` -> N, a positive integer."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"--tp {text!r}: expected the tensor-parallel size, a positive integer, e.g. --tp 4"
        )
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        # the reader stopped reading (``quantdispatch doctor | head -1``): it has what it
        # wanted; no traceback, and nothing more written to the closed stdout
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def _error(exc: Exception) -> None:
    """One line on stderr, whatever the message holds."""
    print("quantdispatch: error: " + " ".join(str(exc).split()), file=sys.stderr)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command = parser.commands.get(args.command, parser)  # its --help is the one to read
    if extra:
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "doctor" and args.tp is not None and not (args.shape or args.moe):
        command.error("--tp splits a layer: give it with --shape NxK or --moe E,TOPK,H,I")
    try:
        if args.command == "doctor":
            from quantdispatch.cli.doctor import run_doctor

            return run_doctor(args)
        if args.command == "presets":
            from quantdispatch.cli.doctor import run_presets

            return run_presets()
        if args.command == "verify":
            from quantdispatch.cli.verify import run_verify

            return run_verify(args.formats, as_json=args.json, fp8=args.fp8_compute)
        parser.print_help()
        return EXIT_USAGE
    except ConfigurationError as exc:
        _error(exc)
        return EXIT_USAGE
    except QuantDispatchError as exc:
        _error(exc)
        return EXIT_DECISION
