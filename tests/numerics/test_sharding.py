"""Tensor-parallel slices of quantized weights sum / concatenate back to the full layer."""

from __future__ import annotations

import pytest
import torch
from ref64 import random_codes, random_e4m3_scales

from quantdispatch.checkpoints import shard_bounds, shard_weight
from quantdispatch.errors import ConfigurationError, WeightFormatError
from quantdispatch.formats import Fp8Weight, Mxfp4Weight, Nvfp4Weight
from quantdispatch.layers import QuantLinear


def _weights(n, k, g):
    return {
        "nvfp4": Nvfp4Weight(
            packed=random_codes(n, k, g),
            block_scale=random_e4m3_scales((n, k // 16), g),
            global_scale=torch.tensor(0.013),
        ),
        "mxfp4": Mxfp4Weight(
            packed=random_codes(n, k, g),
            block_scale=torch.randint(120, 130, (n, k // 32), generator=g).to(torch.uint8),
        ),
        "fp8-channel": Fp8Weight(
            weight=(torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn),
            scale=torch.rand(n, generator=g) + 0.01,
        ),
        "fp8-block": Fp8Weight(
            weight=(torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn),
            scale=torch.rand(-(-n // 32), -(-k // 64), generator=g) + 0.01,
            block_size=(32, 64),
        ),
    }


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4", "fp8-channel", "fp8-block"])
@pytest.mark.parametrize("world", [2, 3])
def test_shards_rebuild_the_full_layer(kind, world):
    g = torch.Generator().manual_seed(world)
    n, k = 100, 192  # N not a multiple of 64 (nor of the ranks): the peers' TP bug
    w = _weights(n, k, g)[kind]
    x = torch.randn(3, k, generator=g).to(torch.float16)
    full = QuantLinear(w, act_dtype=torch.float16, device="cpu")(x).double()

    cols = [shard_weight(w, dim="n", rank=r, world_size=world) for r in range(world)]
    y_n = torch.cat(
        [QuantLinear(c, act_dtype=torch.float16, device="cpu")(x).double() for c in cols], dim=1
    )
    assert torch.equal(y_n, full)  # column slices: the same numbers, concatenated

    y_k, start = torch.zeros_like(full), 0
    for r in range(world):
        part = shard_weight(w, dim="k", rank=r, world_size=world)
        stop = start + part.shape[1]
        layer = QuantLinear(part, act_dtype=torch.float16, device="cpu")
        y_k += layer(x[:, start:stop].contiguous()).double()
        start = stop
    assert start == k
    # row slices: partial sums in fp16 then summed, so within fp16 rounding of the full result
    assert float((y_k - full).norm() / full.norm()) < 2e-3


def test_bounds_and_errors():
    assert shard_bounds(10, 0, 3) == (0, 4) and shard_bounds(10, 2, 3) == (7, 10)
    assert shard_bounds(64, 1, 2, unit=16) == (32, 64)
    with pytest.raises(ConfigurationError, match="0 <= rank < world_size"):
        shard_bounds(10, 3, 3)
    with pytest.raises(WeightFormatError, match="cannot be split over 8 ranks"):
        shard_bounds(64, 0, 8, unit=16)
