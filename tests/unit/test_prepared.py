"""The typed prepare / apply life cycle (backends/prepared.py): every layout's meta survives the
ops' flat form, and a meta that is not its layout's dataclass is refused where it is built."""

from __future__ import annotations

import pytest
import torch

from quantdispatch.backends.base import (
    CheckpointMeta,
    Layout,
    MarlinMeta,
    Mma16x64Meta,
    MoeCall,
    PreparedMoe,
    PreparedWeight,
    ScaledMmMeta,
    decode_meta,
    encode_meta,
)
from quantdispatch.backends.triton.meta import Fp8CheckpointMeta, Fp8Mma16x64Meta
from quantdispatch.errors import ConfigurationError

METAS = [
    (Layout.CHECKPOINT, CheckpointMeta()),
    (Layout.CHECKPOINT, CheckpointMeta(block_size=(128, 128))),
    (Layout.CHECKPOINT, CheckpointMeta(fp16_rebased=True)),
    (Layout.CHECKPOINT, CheckpointMeta(block_size=(1, 32), emulate_activations=True)),
    (Layout.MMA16X64, Mma16x64Meta(torch.bfloat16)),
    (Layout.MMA16X64, Mma16x64Meta(torch.float16)),
    (Layout.MMA16X64, Fp8Mma16x64Meta(torch.bfloat16, fp8_compute="prefill")),
    (Layout.MMA16X64, Fp8Mma16x64Meta(torch.float16, fp8_compute="prefill-resident")),
    (Layout.CHECKPOINT, Fp8CheckpointMeta(fp8_compute="prefill-resident")),
    (Layout.CHECKPOINT, Fp8CheckpointMeta(fp16_rebased=True, fp8_compute="prefill")),
    (Layout.SCALED_MM, ScaledMmMeta()),
    (Layout.MARLIN, MarlinMeta(2, torch.float16, 720, 2880, 768, 2944)),
    (Layout.MARLIN, MarlinMeta(0, torch.bfloat16, 768, 2048, 768, 2048, gated=True)),
]


@pytest.mark.parametrize(("layout", "meta"), METAS)
def test_every_meta_round_trips_the_ops_flat_form(layout, meta):
    flat = encode_meta(layout, meta)
    assert isinstance(flat, list) and all(isinstance(v, int) for v in flat)
    assert decode_meta(flat) == (layout, meta)
    assert decode_meta(torch.tensor(flat).tolist()) == (layout, meta)


def test_a_meta_of_another_layout_or_an_int_tuple_is_refused():
    t = (torch.zeros(1),)
    with pytest.raises(ConfigurationError, match="meta is the dataclass of its layout"):
        PreparedWeight(("w",), t, Layout.MMA16X64, CheckpointMeta())
    with pytest.raises(ConfigurationError, match="meta is the dataclass of its layout"):
        PreparedWeight(("w",), t, Layout.CHECKPOINT, (1, 0))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="meta is the dataclass of its layout"):
        PreparedMoe(("w",), t, t, Layout.MARLIN, ScaledMmMeta())
    x = torch.zeros(1, 4)
    with pytest.raises(ConfigurationError, match="meta is the dataclass of its layout"):
        MoeCall(x, x, x, t, t, None, None, "nvfp4", "silu", (), Layout.SCALED_MM, CheckpointMeta())


@pytest.mark.parametrize(
    "flat",
    [
        [],
        [9],
        [0, 1, 2],
        [1, 5, 0],
        [1, 5],
        [1, 0, 3],
        [1, 0, -1],
        [0, 0, 0, 0, 0, 7],
        [2, 0],
        [16, 0, 0, 0, 0, 9],
    ],
)
def test_malformed_flat_meta_names_itself(flat):
    with pytest.raises(ConfigurationError, match=r"op meta \["):
        decode_meta(flat)


def test_defaults_are_the_checkpoint_layout():
    prepared = PreparedWeight(("w",), (torch.zeros(1),))
    assert prepared.layout is Layout.CHECKPOINT and prepared.meta == CheckpointMeta()
    assert prepared.meta_args() == [0, 0, 0, 0, 0]  # meta code, block (2), flags


def test_an_unknown_fp8_compute_mode_is_refused_where_the_meta_is_built():
    with pytest.raises(ConfigurationError, match="FP8 compute mode is one of off, prefill"):
        Fp8Mma16x64Meta(torch.bfloat16, fp8_compute="on")
    with pytest.raises(ConfigurationError, match="fp8_compute='prefill_resident'"):
        Fp8CheckpointMeta(fp8_compute="prefill_resident")
