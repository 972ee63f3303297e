"""The register-operand wgmma guard (quantdispatch.kernels.common.wgmma_guard): where it holds, and
that every launch whose MMA takes a decoded A operand settles its accumulator where it holds,
keeping its tuned stages (the loads stay pipelined).

The numbers behind it (wrong results of pipelined tiles on the H200 with Triton 3.6, the PTX
waits per Triton version) are in docs/design/wgmma-gemm.md; the GPU regression test is
tests/gpu/test_mma_layout_gemm_gpu.py::test_tiles_that_raced_on_triton_36_match_float64.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (optional extra)")

from quantdispatch.kernels.common import wgmma_guard as wh
from quantdispatch.kernels.common.device_facts import DeviceFacts, device_facts

#: A CPU tensor's facts, with the guard's verdict set: what an SM 9.x launch would see.
SETTLING = replace(device_facts(torch.device("cpu")), rs_wgmma_hazard=True)


@pytest.fixture
def gpu(monkeypatch):
    """Pretend a given Triton version; returns the verdict for a capability."""

    def set_(capability: tuple[int, int], version: tuple[int, int]) -> bool:
        monkeypatch.setattr(wh, "triton_version", lambda: version)
        assert DeviceFacts.for_capability(capability).rs_wgmma_hazard is wh.rs_wgmma_hazard(
            capability
        )
        return wh.rs_wgmma_hazard(capability)

    return set_


@pytest.mark.parametrize(
    ("capability", "version", "hazard"),
    [
        ((9, 0), (3, 6), True),  # the H200 we measure on
        ((9, 0), (3, 3), True),
        ((9, 0), (3, 7), True),  # upstream's fix, not yet verified by us on a GPU
        ((9, 0), (4, 0), True),
        ((8, 0), (3, 6), False),  # no wgmma before Hopper
        ((10, 0), (3, 6), False),  # Blackwell's MMA (tcgen05) takes no register operands
        ((12, 0), (3, 6), False),
    ],
)
def test_hazard_is_hopper_with_an_old_triton(gpu, capability, version, hazard) -> None:
    assert gpu(capability, version) is hazard


def test_a_verified_version_pipelines_again(gpu, monkeypatch) -> None:
    monkeypatch.setattr(wh, "VERIFIED_SAFE_FROM", (3, 7))
    assert not gpu((9, 0), (3, 7))
    assert gpu((9, 0), (3, 6))


def test_no_hazard_off_cuda() -> None:
    assert not wh.rs_wgmma_hazard(None)
    assert not device_facts(torch.device("cpu")).rs_wgmma_hazard


def test_triton_version_reads_the_installed_one(monkeypatch) -> None:
    wh.triton_version.cache_clear()
    monkeypatch.setattr(wh.triton, "__version__", "3.6.0+git1234")
    assert wh.triton_version() == (3, 6)
    wh.triton_version.cache_clear()
    monkeypatch.setattr(wh.triton, "__version__", "nightly")
    assert wh.triton_version() == (0, 0)  # unreadable: treated as affected
    wh.triton_version.cache_clear()


class _FakeKernel:
    """Stands in for a Triton kernel: records the launch options."""

    def __init__(self) -> None:
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)

        return launch


@pytest.mark.parametrize("hazard", [True, False])
def test_the_mid_m_gemm_settles_where_the_hazard_holds(monkeypatch, hazard) -> None:
    from quantdispatch.kernels.mma_layout import gemm, layout
    from quantdispatch.kernels.mma_layout.gemm_tiles import GemmTile

    fake = _FakeKernel()
    monkeypatch.setattr(gemm, "_mma_gemm_kernel", fake)
    facts = replace(SETTLING, rs_wgmma_hazard=hazard)
    packed = torch.zeros(64, 64, dtype=torch.uint8)
    words, scales = layout.repack(
        packed, torch.full((64, 8), 0x38, dtype=torch.uint8), torch.bfloat16
    )
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    gemm.mma_gemm(x, words, scales, torch.ones(1), tile=GemmTile(64, 16, 2, 4, 3), facts=facts)
    assert fake.launches[0]["SETTLE"] is hazard
    assert fake.launches[0]["num_stages"] == 3  # the loads stay pipelined


@pytest.mark.parametrize("swap_ab", [1, 0])
def test_the_checkpoint_tiled_kernel_settles_only_when_swapped(monkeypatch, swap_ab) -> None:
    from quantdispatch.kernels.checkpoint_layout import linear
    from quantdispatch.kernels.common import checks
    from quantdispatch.kernels.common.configs import GemmConfig

    fake = _FakeKernel()
    monkeypatch.setattr(linear, "_fp4_gemm_kernel", fake)
    monkeypatch.setattr(checks, "interpreting", lambda: True)  # x may stay on the CPU
    packed = torch.zeros(64, 64, dtype=torch.uint8)
    scales = torch.full((64, 8), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    x = torch.zeros(40, 128, dtype=torch.bfloat16)
    config = GemmConfig(64, 64, 128, 4, 3, swap_ab=swap_ab)
    linear.fp4_linear(
        x, packed, scales, torch.ones(1), scale_format="e4m3", config=config, facts=SETTLING
    )
    assert fake.launches[0]["SETTLE"] is bool(swap_ab)
    assert fake.launches[0]["num_stages"] == 3


@pytest.mark.parametrize("swap_ab", [1, 0])
def test_the_fp8_tiled_kernel_settles_only_when_swapped(monkeypatch, swap_ab) -> None:
    from quantdispatch.kernels.checkpoint_layout import fp8
    from quantdispatch.kernels.common.configs import GemmConfig

    fake = _FakeKernel()
    monkeypatch.setattr(fp8, "_fp8_gemm_kernel", fake)
    weight = torch.zeros(64, 128, dtype=torch.float8_e4m3fn)
    x = torch.zeros(40, 128, dtype=torch.bfloat16)
    config = GemmConfig(64, 64, 128, 4, 3, swap_ab=swap_ab)
    fp8.fp8_weight_only_linear(
        x, weight, torch.ones(()), block_size=None, config=config, facts=SETTLING
    )
    assert fake.launches[0]["SETTLE"] is bool(swap_ab)
    assert fake.launches[0]["num_stages"] == 3


_LOOP_FACTS = """
import json, sys
sys.path.insert(0, "benchmarks/probes")
import wgmma_waits
tma, spc = sys.argv[1] == "1", int(sys.argv[2])
facts = [wgmma_waits.loop_facts(wgmma_waits.small_gemm(tma, s, spc=spc)) for s in (True, False)]
print(json.dumps(facts))
"""


@pytest.mark.parametrize("spc", [32, 16], ids=["nvfp4", "mxfp4"])
@pytest.mark.parametrize("tma", [False, True])
def test_settled_gemm_waits_for_every_wgmma_and_keeps_its_load_stages(tma, spc) -> None:
    """Compile the mid-M GEMM for sm_90 with 3 stages (no GPU needed: Triton's bundled ptxas;
    in a child process, since the tests run Triton's interpreter): settled, its K loop waits
    with ``wait_group 0`` only and keeps the pipelined loads (cp.async / TMA for later steps);
    unsettled, it waits with counts above 0 (the pipeliner overlapping wgmmas: Triton 3.6
    overwrote A registers then)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", _LOOP_FACTS, str(int(tma)), str(spc)], cwd=root,
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (settled,), (pipelined,) = json.loads(run.stdout.strip().splitlines()[-1])
    assert settled["rs"] > 0 and pipelined["rs"] > 0  # the decoded weight is wgmma's A
    assert settled["waits"] and set(settled["waits"]) == {0}
    assert min(pipelined["waits"]) > 0
    kind = "tma" if tma else "cp_async"
    assert settled[kind] == pipelined[kind] > 0


_A_IN_REGISTERS = """
import json, re, sys
sys.path.insert(0, "benchmarks/probes")
import wgmma_waits
tma, spc = sys.argv[1] == "1", int(sys.argv[2])
sass = wgmma_waits._sass(wgmma_waits.small_gemm(tma, True, spc=spc))
ops = re.findall(r"/\\*[0-9a-f]{4,}\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z0-9_]+)", sass)
print(json.dumps({op: ops.count(op) for op in ("STS", "LDSM", "SHFL", "HGMMA")}))
"""


@pytest.mark.parametrize("spc", [32, 16], ids=["nvfp4", "mxfp4"])
@pytest.mark.parametrize("tma", [False, True])
def test_the_decoded_weight_reaches_wgmma_in_registers(tma, spc) -> None:
    """The GEMM's decoded words go to wgmma as they stand (no shared memory, no shuffles): for
    speed, and for MXFP4 for correctness too, since its PTX picks each lane's scale pair by
    %laneid, which holds only while Triton keeps layout lane 4g + t on PTX lane 4g + t."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    args = [sys.executable, "-c", _A_IN_REGISTERS, str(int(tma)), str(spc)]
    run = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    assert counts["HGMMA"] > 0
    assert counts["STS"] == counts["LDSM"] == counts["SHFL"] == 0, counts
