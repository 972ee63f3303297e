"""Peer kernels timed beside ours in benchmarks/linear.py and benchmarks/moe.py: vLLM's compiled
Marlin GEMMs, run through quantdispatch's marlin backend (docs/design/marlin.md).

What is timed is what QuantLinear / QuantMoE forced to marlin run per call, the way the
scripts time our backends' paths: linear, ``MarlinBackend.linear`` on weights
``MarlinBackend.prepare`` laid out once (copied for the rotation past L2), like ``nvfp4_auto``;
MoE, ``MarlinBackend.moe`` on the stacks ``prepare_moe`` made, routing precomputed, like the
``nvfp4`` / ``mxfp4`` columns. Each is checked against the script's reference first.

The provider: ``--marlin-lib DIR`` (``*.so``, or ``*.so.xz`` decompressed once to /tmp/vllm),
by default ``.peer/vllm`` when it holds libraries, else an installed vLLM. Where none loads,
the columns say "not available: <reason>" and the run goes on.
"""

from __future__ import annotations

import argparse
import lzma
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PEER_DIR = ROOT / ".peer" / "vllm"
LIB_DIR = Path("/tmp/vllm")  # where compressed libraries are decompressed (once per machine)
LINEAR_KERNELS = ["marlin_nvfp4", "marlin_mxfp4"]
MOE_KERNEL = "marlin"
ROLES = {"linear": ("gemm", "repack"), "moe": ("gemm", "repack", "moe")}
REQUIRE_GPU = True  # the CPU tests run the columns on a fake provider


class Unavailable(Exception):
    """Why the Marlin columns cannot run here (the text after "not available: ")."""


def add_args(ap: argparse.ArgumentParser, default_ms: str) -> None:
    g = ap.add_argument_group("Marlin columns (vLLM's compiled kernels)")
    g.add_argument(
        "--marlin-lib",
        type=Path,
        metavar="DIR",
        help="vLLM's libraries (*.so or *.so.xz; default: .peer/vllm when present, else an "
        "installed vLLM)",
    )
    g.add_argument("--marlin-version", help="their vLLM version (default: DIR/VERSION)")
    g.add_argument(
        "--marlin-ms",
        default=default_ms,
        help="M values with Marlin columns: comma-separated, 'quick' (the --quick M values in "
        "this run), 'all' or 'none' (default: %(default)s)",
    )


def parse_ms(text: str, ms: list[int], quick: list[int]) -> list[int]:
    """The run's M values that get Marlin columns; ValueError names the flag."""
    word = text.strip().lower()
    if word == "all":
        return list(ms)
    if word == "none":
        return []
    if word == "quick":
        return [m for m in ms if m in quick]
    parts = [p.strip() for p in word.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"--marlin-ms {text!r}: expected M values (1,16,...), quick, all or none")
    wanted = {int(p) for p in parts}
    missing = sorted(wanted - set(ms))
    if missing:
        raise ValueError(f"--marlin-ms {text!r}: {missing} not among this run's M values {ms}")
    return [m for m in ms if m in wanted]


# ---- the provider ------------------------------------------------------------------------------


def _version(lib_dir: Path, given: str | None) -> str:
    if given:
        return given
    f = lib_dir / "VERSION"
    if f.is_file():  # "vllm==0.33.0" or "0.33.0"
        return f.read_text().strip().split("==")[-1]
    raise Unavailable(f"no VERSION file in {lib_dir}: pass --marlin-version")


def _decompress(xz: Path) -> Path:
    out = LIB_DIR / xz.stem
    if not out.is_file():
        LIB_DIR.mkdir(parents=True, exist_ok=True)
        part = out.with_name(out.name + ".part")
        with lzma.open(xz) as f:
            part.write_bytes(f.read())
        part.rename(out)
    return out


def libraries(lib_dir: Path) -> list[Path]:
    """The libraries in ``lib_dir``: ``*.so`` as they are, ``*.so.xz`` decompressed to LIB_DIR
    (a library present both ways is taken uncompressed)."""
    plain = sorted(lib_dir.glob("*.so"))
    names = {p.name for p in plain}
    packed = [x for x in sorted(lib_dir.glob("*.so.xz")) if x.stem not in names]
    libs = plain + [_decompress(x) for x in packed]
    if not libs:
        raise Unavailable(f"no *.so or *.so.xz in {lib_dir}")
    return libs


def load_provider(lib_dir: Path | None, version: str | None, op: str):
    """Register the libraries (if any) and return the active provider's status, its ops of
    ``op`` checked against the contract; Unavailable with the reason otherwise."""
    from quantdispatch.backends import marlin_providers

    if lib_dir is None and PEER_DIR.is_dir() and any(PEER_DIR.glob("*.so*")):
        lib_dir = PEER_DIR
    loaded = []
    if lib_dir is not None:
        if not lib_dir.is_dir():
            raise Unavailable(f"--marlin-lib {lib_dir}: no such directory")
        ver = _version(lib_dir, version)
        for lib in libraries(lib_dir):
            try:
                marlin_providers.load_library(lib, provider="vllm", version=ver)
            except Exception as exc:
                raise Unavailable(f"loading {lib}: {_short(exc)}") from exc
            loaded.append(str(lib))
    status = marlin_providers.active()
    if status is None:
        found = "; ".join(s.describe() for s in marlin_providers.statuses())
        raise Unavailable(f"no usable Marlin provider ({found})")
    try:
        marlin_providers.ensure_loaded(status, ROLES[op])
    except Exception as exc:
        raise Unavailable(_short(exc)) from exc
    return status, loaded


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


@dataclass
class Marlin:
    """The Marlin columns of one run: where they run, the provider or why not."""

    ms: list[int]
    available: bool
    status: str
    """The provider ("vllm 0.33.0 [...]") or "not available: <reason>"."""
    meta: dict = field(default_factory=dict)
    """Written into the result JSON's meta["marlin"]; models skipped are added as they come."""

    def runs(self, m: int) -> bool:
        return self.available and m in self.ms

    def moe(self, layer, name: str) -> MarlinMoe | None:
        """The Marlin op on ``layer``'s experts, or None (the reason goes into the meta)."""
        if not self.available or not self.ms:
            return None
        try:
            return MarlinMoe(layer)
        except Exception as exc:
            self.meta.setdefault("skipped", {})[name] = _short(exc)
            print(f"  {name}: Marlin not available: {_short(exc)}", flush=True)
            return None


def setup(
    args: argparse.Namespace, ms: list[int], quick: list[int], op: str, skip: str | None = None
) -> Marlin:
    """Parse --marlin-ms and load the provider (only when some M wants it and no ``skip``
    reason is given)."""
    want = [] if skip else parse_ms(args.marlin_ms, ms, quick)
    t0 = time.time()
    loaded: list[str] = []
    if not want:
        status = f"not run ({skip or '--marlin-ms: no M of this run'})"
        available = False
    elif REQUIRE_GPU and not torch.cuda.is_available():
        status, available = "not available: no CUDA GPU", False
    else:
        try:
            provider, loaded = load_provider(args.marlin_lib, args.marlin_version, op)
            status, available = provider.describe(), True
            if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
                status, available = "not available: bf16 Marlin needs SM 8.0+", False
        except Unavailable as exc:
            status, available = f"not available: {exc}", False
    meta = {"status": status, "available": available, "ms": want, "libraries": loaded,
            "setup_s": round(time.time() - t0, 1)}  # fmt: skip
    print(f"Marlin: {status}" + (f" at M {want}" if available else ""), flush=True)
    return Marlin(want, available, status, meta)


# ---- linear ------------------------------------------------------------------------------------


def _prepared_linear(p, fmt: str) -> tuple[list[list[torch.Tensor]], list[int]]:
    """The Problem's weight as MarlinBackend.prepare lays it out, once, and p.copies copies."""
    cache = p.__dict__.setdefault("_marlin", {})
    if fmt not in cache:
        from quantdispatch.backends.marlin import MarlinBackend
        from quantdispatch.formats import Mxfp4Weight, Nvfp4Weight
        from quantdispatch.request import Request

        packed, scale = (p.nv if fmt == "nvfp4" else p.mx)[0]
        if fmt == "nvfp4":
            weight = Nvfp4Weight(packed, scale, p.gscale)
        else:
            weight = Mxfp4Weight(packed, scale)
        request = Request.make(fmt, "linear", torch.bfloat16, n=p.n, k=p.k)
        prepared = MarlinBackend().prepare(weight, request)
        first = list(prepared.tensors)
        copies = [first] + [[t.clone() for t in first] for _ in range(p.copies - 1)]
        cache[fmt] = (copies, (prepared.layout, prepared.meta))
    return cache[fmt]


def linear_calls(p, kernel: str, m: int, gen):
    """(rotated zero-arg calls, float64 reference) for ``marlin_nvfp4`` / ``marlin_mxfp4`` on a
    benchmarks/linear.py Problem: what QuantLinear forced to marlin runs per call."""
    from quantdispatch.backends.marlin import MarlinBackend

    fmt = kernel.removeprefix("marlin_")
    from quantdispatch.backends.bound import LinearBinding

    weights, (layout, meta) = _prepared_linear(p, fmt)
    backend = MarlinBackend()
    xs = p.xs(m, len(weights), gen)
    binds = [LinearBinding(tuple(w), None, fmt, layout, meta, True, w[0].device) for w in weights]
    calls = [(lambda x=x, b=b: backend.linear(x, b)) for x, b in zip(xs, binds, strict=True)]
    return calls, lambda: xs[0].double() @ p.w64[fmt].T


def _ratio(num: dict | None, den: dict | None) -> str:
    ok = num and den and num.get("us") and den.get("us")
    return f"{num['us'] / den['us']:.2f}x" if ok else "-"


def _cell(r: dict | None, marlin: dict, name: str) -> str:
    if not marlin.get("available") or name in marlin.get("skipped", {}):
        return "n/a"
    if r is None:
        return "-"
    return "FAIL" if r["us"] is None else f"{r['us']:.1f}"


def linear_head(meta: dict) -> tuple[str, str]:
    """The Marlin columns' header and separator cells (empty when the run had none)."""
    if "marlin" not in meta:
        return "", ""
    head = (" Marlin NVFP4 | Marlin MXFP4 | bf16/Marlin NV | Marlin NV/auto | bf16/Marlin MX "
            "| Marlin MX/auto |")  # fmt: skip
    return head, "---|" * 6


def linear_cells(meta: dict, by: dict, shape: str, m: int) -> str:
    if "marlin" not in meta:
        return ""
    info = meta["marlin"]
    nv, mx = (by.get((shape, m, k)) for k in LINEAR_KERNELS)
    bf = by.get((shape, m, "bf16"))
    cells = [
        _cell(nv, info, shape),
        _cell(mx, info, shape),
        _ratio(bf, nv),
        _ratio(nv, by.get((shape, m, "nvfp4_auto"))),
        _ratio(bf, mx),
        _ratio(mx, by.get((shape, m, "mxfp4_auto"))),
    ]
    return " " + " | ".join(cells) + " |"


def linear_note(meta: dict) -> str:
    if "marlin" not in meta:
        return ""
    info = meta["marlin"]
    if not info.get("available"):
        return f"Marlin columns (n/a): {info['status']}."
    return (
        f"Marlin NVFP4 / MXFP4 = {info['status']}: its compiled marlin_gemm through "
        "quantdispatch's marlin backend, i.e. MarlinBackend.linear on the weight "
        "MarlinBackend.prepare laid out (the call QuantLinear forced to marlin makes), timed "
        "like NVFP4 auto (same graphs, rotation and float64 check), at M in "
        f"{info['ms']} ('-' elsewhere). Ratios are times: bf16/Marlin > 1 means Marlin beats "
        "bf16; Marlin/auto > 1 means our auto path beats Marlin (the speed-up of triton over "
        "Marlin)."
    )


# ---- MoE ---------------------------------------------------------------------------------------


class MarlinMoe:
    """A benchmarks/moe.py Layer's experts in Marlin's form; called like Layer.nvfp4: the whole
    op QuantMoE forced to marlin runs (alignment, two grouped GEMMs, activation, biases, the
    weighted top-k sum), routing precomputed."""

    def __init__(self, layer):
        from quantdispatch.backends.base import CheckpointMeta, ExpertStacks
        from quantdispatch.backends.marlin import MarlinBackend
        from quantdispatch.moe.stacking import STACK_NAMES
        from quantdispatch.request import Request

        self.layer = layer
        self.backend = MarlinBackend()
        request = Request.make(
            layer.fmt, "moe", torch.bfloat16, n=layer.i, k=layer.h, experts=layer.e
        )
        stacks = ExpertStacks(layer.w13, layer.w2, STACK_NAMES[layer.fmt], CheckpointMeta(), True)
        prepared = self.backend.prepare_moe(stacks, request)
        self.w13, self.w2 = tuple(prepared.w13), tuple(prepared.w2)
        self.layout, self.meta = prepared.layout, prepared.meta

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        from quantdispatch.backends.base import MoeCall

        lay = self.layer
        call = MoeCall(x, ids, w, self.w13, self.w2, lay.b13, lay.b2, lay.fmt, lay.act,
                       tuple(lay.params), self.layout, self.meta)  # fmt: skip
        return self.backend.moe(call)


def moe_head(meta: dict, fmt: str) -> tuple[str, str]:
    if "marlin" not in meta:
        return "", ""
    return f" marlin | bf16/marlin | marlin/{fmt} | err marlin |", "---|" * 4


def moe_cells(meta: dict, by: dict, model: str, m: int, fmt: str) -> str:
    if "marlin" not in meta:
        return ""
    r = by.get((model, m, MOE_KERNEL))
    err = f"{r['rel_err']:.1e}" if r and r.get("rel_err") == r.get("rel_err") else "-"
    cells = [
        _cell(r, meta["marlin"], model),
        _ratio(by.get((model, m, "bf16")), r),
        _ratio(r, by.get((model, m, fmt))),
        err,
    ]
    return " " + " | ".join(cells) + " |"


def moe_note(meta: dict, fmt: str) -> str:
    if "marlin" not in meta:
        return ""
    info = meta["marlin"]
    if not info.get("available"):
        return f"marlin column (n/a): {info['status']}."
    skipped = "".join(f" {k}: not available: {v}." for k, v in info.get("skipped", {}).items())
    return (
        f"marlin = {info['status']}: its fused Marlin MoE GEMM for both expert GEMMs through "
        "quantdispatch's marlin backend, i.e. MarlinBackend.moe on the stacks prepare_moe made "
        "(block alignment, activation, biases and top-k weights ours, in torch): the op "
        f"QuantMoE forced to marlin runs, routing precomputed and timed like the {fmt} column, "
        f"at M in {info['ms']} ('-' elsewhere). Ratios are times: bf16/marlin > 1 means Marlin "
        f"beats bf16; marlin/{fmt} > 1 means our {fmt} path beats Marlin.{skipped}"
    )
