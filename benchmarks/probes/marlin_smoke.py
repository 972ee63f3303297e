#!/usr/bin/env python3
"""First contact with vLLM's Marlin on a GPU: load the library, print the op schemas, run one
product per (format, activation dtype) and one small MoE, each against float64 / the reference
backend. Run it before tests/gpu/test_marlin_gpu.py to confirm the contract quickly.

    PYTHONPATH=$PWD python3 benchmarks/probes/marlin_smoke.py [--lib-dir /tmp/vllm] \
        [--version 0.33.0]

Libraries: ``--lib-dir`` (``*.so``), else ``.peer/vllm/*.so.xz`` decompressed to /tmp/vllm,
else an installed vLLM. Exit status 1 if anything fails or exceeds its bound.
"""

from __future__ import annotations

import argparse
import lzma
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from quantdispatch.api import load_settings
from quantdispatch.backends import marlin_providers
from quantdispatch.formats import (
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_mxfp4,
    quantize_nvfp4,
)
from quantdispatch.layers import QuantLinear, QuantMoE

ROOT = Path(__file__).resolve().parents[2]
BOUND = {torch.bfloat16: 1e-2, torch.float16: 4e-3}


def _libraries(lib_dir: Path | None) -> tuple[list[Path], str | None]:
    if lib_dir is not None:
        return sorted(lib_dir.glob("*.so")), None
    peer = ROOT / ".peer" / "vllm"
    archives = sorted(peer.glob("*.so.xz")) if peer.is_dir() else []
    out_dir = Path("/tmp/vllm")
    libs = []
    for xz in archives:
        out_dir.mkdir(exist_ok=True)
        out = out_dir / xz.stem
        if not out.is_file():
            with lzma.open(xz) as f:
                out.write_bytes(f.read())
        libs.append(out)
    version = None
    if (peer / "VERSION").is_file():
        version = (peer / "VERSION").read_text().strip().split("==")[-1]
    return libs, version


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _report(name: str, err: float, bound: float) -> bool:
    ok = err < bound
    print(f"  {name:<44} rel err {err:.3e}  (bound {bound:.0e})  {'ok' if ok else 'FAIL'}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib-dir", type=Path)
    ap.add_argument("--version", help="provider version of the libraries (default: VERSION)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, ", end="")
    if not torch.cuda.is_available():
        print("no GPU")
        return 1
    print(torch.cuda.get_device_name())
    libs, version = _libraries(args.lib_dir)
    version = args.version or version or "0.33.0"
    for lib in libs:
        try:
            marlin_providers.load_library(lib, provider="vllm", version=version)
            print(f"loaded {lib} as vllm {version}")
        except Exception as exc:
            print(f"loading {lib} failed: {type(exc).__name__}: {exc}")
            return 1
    for s in marlin_providers.statuses():
        print(f"provider {s.describe()}")
    status = marlin_providers.active()
    if status is None or status.contract is None:
        return 1
    row = status.contract
    marlin_providers.ensure_loaded(status, ("gemm", "repack"))
    for role in row.ops:
        try:
            print(f"{role}: {row.op(role).default._schema}")
        except Exception as exc:
            print(f"{role}: not registered ({exc})")
    ok = True
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    print("linear, 4096 x 4096 and the 720 x 2880 shard, M = 16, QuantLinear forced to marlin:")
    for fmt, act in (
        ("nvfp4", torch.bfloat16),
        ("nvfp4", torch.float16),
        ("mxfp4", torch.bfloat16),
    ):
        for n, k in ((4096, 4096), (720, 2880)):
            try:
                w = torch.randn(n, k, device=dev, generator=g) * 0.02
                q = quantize_nvfp4(w) if fmt == "nvfp4" else quantize_mxfp4(w)
                deq = dequantize_nvfp4 if fmt == "nvfp4" else dequantize_mxfp4
                forced = load_settings({}, backend={fmt: "marlin"})
                layer = QuantLinear(q, act_dtype=act, device=dev, settings=forced)
                x = torch.randn(16, k, device=dev, generator=g).to(act)
                err = _rel(layer(x), x.double() @ deq(q, dtype=torch.float64).T)
                ok &= _report(f"{fmt} {str(act)[6:]} {n}x{k}", err, BOUND[act])
            except Exception:
                traceback.print_exc()
                ok = False
    if status.offers("moe"):
        print("MoE, 16 experts top 4, H 2048, I 768, 32 tokens, against the reference backend:")
        for fmt, act in (("nvfp4", torch.bfloat16), ("mxfp4", torch.bfloat16)):
            try:
                quant = quantize_nvfp4 if fmt == "nvfp4" else quantize_mxfp4
                gate, up, down = (
                    [quant(torch.randn(n, k, device=dev, generator=g) / k**0.5) for _ in range(16)]
                    for n, k in ((768, 2048), (768, 2048), (2048, 768))
                )
                kw = dict(top_k=4, act_dtype=act, device=dev, renormalize=True)
                marlin = QuantMoE(
                    gate, up, down, settings=load_settings({}, backend={fmt: "marlin"}), **kw
                )
                ref = QuantMoE(
                    gate, up, down, settings=load_settings({}, backend={fmt: "reference"}), **kw
                )
                x = torch.randn(32, 2048, device=dev, generator=g).to(act)
                logits = torch.randn(32, 16, device=dev, generator=g)
                err = _rel(marlin(x, logits), ref(x, logits))
                ok &= _report(f"moe {fmt} {str(act)[6:]}", err, 1.5e-2)
            except Exception:
                traceback.print_exc()
                ok = False
    else:
        print("MoE op not registered: load _moe_C_stable_libtorch.abi3.so too")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
