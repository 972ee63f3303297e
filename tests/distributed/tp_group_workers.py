"""Rank code of the process-group test: each rank loads one row-parallel layer of the checkpoint
in ``folder`` with ``process_group`` and writes what happened to ``folder/group{rank}.json``."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from quantdispatch import QuantLinear
from quantdispatch.checkpoints import SafetensorsStateDict
from quantdispatch.errors import ConfigurationError
from quantdispatch.layers import load_linear

PREFIX = "model.layers.0.proj"


def run(rank: int, world: int, folder: str) -> None:
    sd = SafetensorsStateDict(Path(folder) / "model.safetensors")
    group = dist.group.WORLD
    out: dict[str, object] = {}
    from_group = QuantLinear.from_checkpoint(
        sd, PREFIX, parallel="row", process_group=group, device="cpu"
    )
    out["in_features"] = from_group.in_features
    dense = load_linear(sd, "dense.o", {"quant_method": "fp8", "ignored_layers": ["dense.o"]},
                        parallel="row", process_group=group, device="cpu")  # fmt: skip
    out["dense_in"] = dense.in_features
    wrong_size = 4 if rank == 1 else world  # rank 1 disagrees with its peers
    for name, kw in (("size", {"tp_size": wrong_size}), ("rank", {"tp_rank": 0})):
        try:
            QuantLinear.from_checkpoint(
                sd, PREFIX, parallel="row", process_group=group, device="cpu", **kw
            )
            out[name] = "ok"
        except ConfigurationError as exc:
            out[name] = str(exc)
    (Path(folder) / f"group{rank}.json").write_text(json.dumps(out))
