"""Static check of the register-operand wgmma hazard, no GPU needed (quantdispatch/kernels/
common/wgmma_guard.py says what it is): compile our Hopper tl.dot kernels for sm_90 with the
installed Triton and list, per K loop, how many wgmmas take A from registers ("RS") and which
``wgmma.wait_group`` counts the loop body has. An RS loop whose body waits only with a count above 0
lets the next step overwrite A registers of wgmmas still in flight.

    python benchmarks/probes/wgmma_waits.py                           # every kernel, 3 stages and 1
    PYTHONPATH=/tmp/triton36 python benchmarks/probes/wgmma_waits.py  # another Triton (--target)

The output is what docs/design/wgmma-gemm.md quotes for Triton 3.6 and 3.7.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from quantdispatch.kernels.checkpoint_layout import fp8 as fp8_linear
from quantdispatch.kernels.checkpoint_layout import linear as fp4_linear
from quantdispatch.kernels.common.wgmma_guard import UPSTREAM_FIX, triton_version
from quantdispatch.kernels.mma_layout import gemm, moe_gemm

LOOP = re.compile(r"Inner Loop Header.*?\n(.*?)@%p\d+ bra\s+\$L__BB\d+_\d+;", re.S)
RS = re.compile(r"wgmma\.mma_async[^;]*?\{[^}]*\},\s*\{")  # A given as a register list
SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")


def _compile(fn, pointers: dict, constexprs: dict, warps: int, stages: int) -> str:
    names = fn.arg_names
    # constexpr parameters left at their defaults (e.g. SPC) stay compile-time constants
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    constexprs = {**defaults, **constexprs}

    def kind(n: str) -> str:
        if n in constexprs:
            return "constexpr"
        return "fp32" if n in ("alpha", "limit") else "i32"

    signature = {n: pointers.get(n, kind(n)) for n in names}
    aligned = [n for n in names if n in pointers and not pointers[n].startswith("tensordesc")]
    aligned += [n for n in names if n.startswith("stride") or n == "K"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": warps, "num_stages": stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def _sass(kernel) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout


def _register(token: str) -> int | None:
    found = re.match(r"R(\d+)", token.rstrip(","))
    return int(found.group(1)) if found else None


def _writes(ins: str) -> set[int]:
    """Registers an instruction writes (its first operand), for the usual ALU / load forms."""
    words = ins.split()
    words = words[1:] if words and words[0].startswith("@") else words
    skip = ("HGMMA", "WARPGROUP", "BAR", "BRA", "ST", "LDGSTS", "SYNCS", "UTMA", "DEPBAR",
            "LDGDEPBAR", "MEMBAR", "FENCE", "U", "NOP", "EXIT", "RET")  # fmt: skip
    if len(words) < 2 or words[0].startswith(skip):
        return set()
    first = _register(words[1])
    if first is None:
        return set()
    width = 4 if ".128" in words[0] else 2 if (".64" in words[0] or "WIDE" in words[0]) else 1
    return set(range(first, first + width))


def in_flight_writes(sass: str) -> int:
    """In the K loop with the most HGMMAs, run twice: HGMMAs form groups (closed by ``gsb0``)
    that stay pending until a ``WARPGROUP.DEPBAR.LE gsb0, N`` leaves at most N; count the
    instructions of the second pass that write an A register of a pending or open group. 0 is
    safe by construction; more may still be safe if ptxas orders them itself (SASS cannot show)."""
    code = [(int(a, 16), i) for a, i in SASS_LINE.findall(sass)]
    loops = []
    for addr, ins in code:
        back = re.search(r"BRA\s.*?0x([0-9a-f]+)", ins)
        if back and int(back.group(1), 16) < addr:
            loops.append([i for a, i in code if int(back.group(1), 16) <= a <= addr])
    body = max(loops, key=lambda b: sum("HGMMA" in i for i in b), default=[])
    pending: list[set[int]] = []
    group: set[int] = set()
    hits = 0
    for second in (False, True):
        for ins in body:
            if "HGMMA" in ins:
                a = _register(ins.split()[2]) if len(ins.split()) > 2 else None
                group |= set(range(a, a + 4)) if a is not None else set()
                if "gsb0" in ins:
                    pending, group = [*pending, group], set()
                continue
            wait = re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)", ins)
            if wait:
                pending = pending[len(pending) - min(len(pending), int(wait.group(1), 16)) :]
                continue
            live = set().union(group, *pending)
            hits += bool(second and _writes(ins) & live)
    return hits


def loop_facts(kernel) -> list[dict]:
    """Per K loop with wgmma in the PTX: RS wgmmas, ``wait_group`` counts, and async loads
    (cp.async / TMA copies issued for later steps: the pipelined loads)."""
    facts = []
    for body in (b for b in LOOP.findall(kernel.asm["ptx"]) if "wgmma.mma_async" in b):
        facts.append({
            "rs": len(RS.findall(body)),
            "waits": [int(w) for w in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", body)],
            "cp_async": len(re.findall(r"cp\.async\.c[ag]\.", body)),
            "tma": len(re.findall(r"cp\.async\.bulk\.tensor", body)),
        })  # fmt: skip
    return facts


def small_gemm(tma: bool, settle: bool, stages: int = 3, spc: int = 32):
    """The mid-M GEMM compiled for sm_90 at a small size (64x64 tiles, K = 512): what
    tests/unit/test_wgmma_guard.py inspects (spc 16: the MXFP4 layout's shared scale pairs)."""
    ptrs = {"x_ptr": "*bf16", "gs_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*bf16",
            "w_ptr": "*i32", "s_ptr": "*i16"}  # fmt: skip
    if tma:
        ptrs["x_ptr"] = "tensordesc<bf16[64, 128]>"
    consts = dict(CHUNKS=8, PER_SPLIT=8, BLOCK_N=64, BLOCK_M=64, CK=2, SPLIT=1, BF16=True,
                  HAS_BIAS=False, DOT_F32=False, X_TMA=tma, SETTLE=settle, PDL=True,
                  SPC=spc)  # fmt: skip
    return _compile(gemm._mma_gemm_kernel, ptrs, consts, 4, stages)


def report(label: str, kernel) -> None:
    facts = loop_facts(kernel)
    if not facts:
        print(f"  {label}: no wgmma in a loop (mma.sync or synchronous)")
    writes = in_flight_writes(_sass(kernel)) if facts else 0
    for f in facts:
        rs, waits = f["rs"], f["waits"]
        if not (rs > 0 and waits and min(waits) > 0):
            verdict = "ok"
        elif triton_version() >= UPSTREAM_FIX:
            verdict = "RS without wait 0: relies on the upstream fix (waits name the A registers)"
        else:
            verdict = "UNSAFE (RS, no wait 0 in the step)"
        print(f"  {label}: {rs} RS wgmma, waits {waits}, SASS writes to in-flight A: {writes},"
              f" async loads {f['cp_async']} cp.async + {f['tma']} TMA -> {verdict}")  # fmt: skip


def main() -> None:
    print(f"triton {triton.__version__}, sm_90; s3 = 3 stages, +settle = what SM 9.x runs")
    variants = ((3, False), (3, True))  # (stages, SETTLE)
    bf16 = {"x_ptr": "*bf16", "gs_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*bf16"}
    mma = {**bf16, "w_ptr": "*i32", "s_ptr": "*i16"}
    for tma in (False, True):
        for stages, settle in variants:
            ptrs = dict(mma, x_ptr="tensordesc<bf16[128, 128]>") if tma else mma
            consts = dict(CHUNKS=64, PER_SPLIT=64, BLOCK_N=128, BLOCK_M=128, CK=2, SPLIT=1,
                          BF16=True, HAS_BIAS=False, DOT_F32=False, X_TMA=tma,
                          SETTLE=settle, PDL=True)  # fmt: skip
            kernel = _compile(gemm._mma_gemm_kernel, ptrs, consts, 8, stages)
            label = f"128x128x128w8s{stages}{'t' if tma else ''}{' +settle' if settle else ''}"
            report(f"mma16x64 GEMM {label}", kernel)
    moe = {**mma, "sorted_ptr": "*i32", "bexp_ptr": "*i32", "nvalid_ptr": "*i32", "tw_ptr": "*fp32"}
    for stages, settle in variants:
        consts = dict(CHUNKS=32, BLOCK_N=64, BLOCK_M=64, CK=2, GATE_UP=True, ACT=0,
                      HAS_BIAS=False, BF16=True, DOT_F32=False, SETTLE=settle)  # fmt: skip
        kernel = _compile(moe_gemm._moe_gemm_kernel, moe, consts, 4, stages)
        report(f"MoE grouped GEMM 64x64x128w4s{stages}{' +settle' if settle else ''}", kernel)
    ckpt = {**bf16, "w_ptr": "*u8", "s_ptr": "*u8", "bias_ptr": "*bf16"}
    for swap in (True, False):
        for stages, settle in variants if swap else variants[:1]:
            consts = dict(GROUP=16, SCALE_E8M0=False, HAS_GS=True, HAS_BIAS=False, EVEN_K=True,
                          DOT_F32=False, DEQ16=True, BF16=True, SWAP_AB=swap, BLOCK_M=64,
                          BLOCK_N=128, BLOCK_K=128, GROUP_M=8, SETTLE=settle)  # fmt: skip
            kernel = _compile(fp4_linear._fp4_gemm_kernel, ckpt, consts, 4, stages)
            tag = f"swap_ab={int(swap)} s{stages}{' +settle' if settle else ''}"
            report(f"checkpoint FP4 tiled {tag}", kernel)
    fp8 = {
        "x_ptr": "*bf16",
        "w_ptr": "*u8",
        "s_ptr": "*fp32",
        "bias_ptr": "*bf16",
        "out_ptr": "*bf16",
    }
    for swap in (True, False):
        for stages, settle in variants if swap else variants[:1]:
            consts = dict(SCALE_KIND=1, BLOCK_SN=1, BLOCK_SK=1, HAS_BIAS=False, EVEN_K=True,
                          DOT_F32=False, BF16=True, DEQ16=True, SWAP_AB=swap, BLOCK_M=64,
                          BLOCK_N=128, BLOCK_K=128, GROUP_M=8, SETTLE=settle)  # fmt: skip
            kernel = _compile(fp8_linear._fp8_gemm_kernel, fp8, consts, 4, stages)
            tag = f"swap_ab={int(swap)} s{stages}{' +settle' if settle else ''}"
            report(f"FP8 W8A16 tiled {tag}", kernel)


if __name__ == "__main__":
    main()
