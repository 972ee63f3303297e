"""What ``quantdispatch doctor --model PATH`` shows: a checkpoint's quantized layer kinds and the
backend ``select()`` picks for each here (or on a simulated preset), with the reason.

Reads config.json, the quantization config and the safetensors headers only (no tensor data,
no transformers import), so it answers in well under a second for any model size.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from quantdispatch import select
from quantdispatch.checkpoints import QuantConfig, load_quant_config
from quantdispatch.errors import QuantDispatchError
from quantdispatch.integrations.transformers.checkpoint import read_config, read_headers
from quantdispatch.kernels.regimes import m_span

__all__ = ["describe_model", "render_description"]

_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)$")
_FLAT = re.compile(r"^(?P<mod>.+)_(?P<leaf>blocks|scales|bias)$")
_FIRST_PROJ = ("gate_proj", "up_proj", "w1", "w3")
_QUANT_LEAVES = {"weight_packed", "weight_scale", "weight_scale_inv", "blocks"}


def _modules(headers: Mapping[str, tuple[str, tuple[int, ...]]]) -> dict[str, dict[str, Any]]:
    mods: dict[str, dict[str, Any]] = {}
    for name, info in headers.items():
        mod, _, leaf = name.rpartition(".")
        flat = _FLAT.match(name)
        if flat and leaf.endswith(("_blocks", "_scales")):
            mod, leaf = flat["mod"], flat["leaf"]
        mods.setdefault(mod, {})[leaf] = info
    return mods


def _layer(leaves: Mapping[str, Any]) -> tuple[str, int, int, str | None, int | None] | None:
    """(format, N, K, fp8 scale kind, experts or None) of a quantized module, else None."""
    if not set(leaves) & _QUANT_LEAVES:
        return None
    if "blocks" in leaves:  # gpt-oss: [(E,) N, K/32, 16]
        shape = leaves["blocks"][1]
        experts = shape[0] if len(shape) == 4 else None
        return "mxfp4", shape[-3], shape[-2] * 32, None, experts
    if "weight_packed" in leaves:
        n, half_k = leaves["weight_packed"][1][:2]
        scale = leaves.get("weight_scale", ("", ()))[0]
        return ("mxfp4" if scale == "U8" else "nvfp4"), n, 2 * half_k, None, None
    dtype, shape = leaves["weight"]
    if dtype == "U8":
        return "nvfp4", shape[0], 2 * shape[1], None, None
    scale = leaves.get("weight_scale_inv") or leaves.get("weight_scale")
    numel = 1
    for d in scale[1]:
        numel *= d
    kind = "tensor" if numel == 1 else "channel" if numel == shape[0] else "block"
    if "weight_scale_inv" in leaves:
        kind = "block"
    return "fp8", shape[0], shape[1], kind, None


def _scheme(quant: QuantConfig | None, module: str, leaves: Mapping[str, Any], fmt: str) -> str:
    if quant is not None:
        lq = quant.layer(module)
        if lq is not None:
            return lq.scheme.value
    if {"input_scale", "input_global_scale"} & set(leaves) or fmt == "fp8":
        return "weight_act"
    return "weight_only"


def _kernel_ranges(decision: Any, top_k: int | None, op: str) -> list[dict[str, Any]]:
    """The kernel family per range of M (tokens) where the Decision can say it, else []."""
    ranges = getattr(decision, "kernel_ranges", None)
    if not callable(ranges) or (op == "moe" and top_k is None):
        return []
    try:
        found = ranges(top_k=int(top_k)) if op == "moe" else ranges()
    except QuantDispatchError:
        return []
    out: list[dict[str, Any]] = []
    for r in found:  # adjacent ranges of one family read as one
        if out and out[-1]["family"] == r.family:
            out[-1]["m_max"] = r.last_m
        else:
            out.append({"m_min": r.first_m, "m_max": r.last_m, "family": r.family})
    return out


def _layer_kinds(
    mods: Mapping[str, Mapping[str, Any]], quant: QuantConfig | None
) -> tuple[dict[tuple, dict[str, Any]], list[str]]:
    """The checkpoint's quantized layer kinds, keyed (op, format, scheme, N, K, experts, fp8
    scale kind), each with its module names; and the unquantized 2-D weights."""
    kinds: dict[tuple, dict[str, Any]] = {}
    unquantized: list[str] = []
    moe: dict[str, dict[str, Any]] = {}
    for name in sorted(mods):
        leaves = mods[name]
        layer = _layer(leaves)
        if layer is None:
            w = leaves.get("weight")
            if w is not None and len(w[1]) == 2 and "embed" not in name:
                unquantized.append(name)
            continue
        fmt, n, k, scale_kind, experts = layer
        scheme = _scheme(quant, name, leaves, fmt)
        expert = _EXPERT.match(name)
        if expert or experts is not None:
            _add_expert(moe, name, expert, layer, scheme)
            continue
        key = ("linear", fmt, scheme, n, k, None, scale_kind)
        kinds.setdefault(key, {"names": []})["names"].append(name)
    for block, entry in moe.items():
        key = (
            "moe",
            entry["format"],
            entry["scheme"],
            entry.get("n"),
            entry.get("k"),
            len(entry["ids"]),
            entry["scale_kind"],
        )
        kinds.setdefault(key, {"names": []})["names"].append(block)
    return kinds, unquantized


def _add_expert(
    moe: dict[str, dict[str, Any]],
    name: str,
    expert: re.Match[str] | None,
    layer: tuple[str, int, int, str | None, int | None],
    scheme: str,
) -> None:
    """Fold one expert module (``...experts.E.proj``) or stacked experts into its MoE block."""
    fmt, n, k, scale_kind, experts = layer
    block = expert["block"] if expert else name.rpartition(".experts.")[0]
    entry = moe.setdefault(block, {"format": fmt, "scheme": scheme, "ids": set()})
    entry["scale_kind"] = scale_kind
    proj = expert["proj"] if expert else name.rpartition(".")[2]
    if expert:
        entry["ids"].add(int(expert["e"]))
    else:
        entry["ids"] = set(range(experts or 0))
    if proj in _FIRST_PROJ or proj == "gate_up_proj":
        entry["n"] = n // 2 if proj == "gate_up_proj" else n
        entry["k"] = k


def _kind_row(key: tuple, names: list[str], decision: Any, top_k: Any) -> dict[str, Any]:
    """describe_model's row of one layer kind and its decision."""
    op, fmt, scheme, n, k, experts, scale_kind = key
    row: dict[str, Any] = {
        "op": op,
        "format": fmt,
        "scheme": scheme,
        "scheme_label": decision.request.scheme_label,
        "n": n,
        "k": k,
        "experts": experts,
        "scale_kind": scale_kind,
        "count": len(names),
        "examples": names[:3],
        "backend": decision.backend,
        "reason": decision.reason,
        "forced_by": decision.forced_by,
        "fallback": decision.is_fallback,
        "rejected": [{"backend": c.backend, "reason": c.reason} for c in decision.rejected()],
    }
    if op == "moe":
        row["top_k"] = top_k
    row["kernels"] = _kernel_ranges(decision, row.get("top_k"), op)
    return row


def describe_model(
    path: str | Path,
    profile_or_device: object = None,
    *,
    act_dtype: torch.dtype = torch.bfloat16,
    policy: Any = None,
    settings: Any = None,
) -> dict[str, Any]:
    """The quantized layer kinds of the checkpoint at ``path`` and, for each, the decision on
    ``profile_or_device`` (None: this machine; a preset name such as ``"h100"``; ``"cpu"``;
    ``"cuda:1"``; a DeviceProfile)."""
    p = Path(path)
    cfg_file = p / "config.json"
    config = read_config(cfg_file) if cfg_file.is_file() else {}
    text = config.get("text_config", config)
    text = text if isinstance(text, dict) else {}
    quant = load_quant_config(p)
    kinds, unquantized = _layer_kinds(_modules(read_headers(p)), quant)

    layers = []
    device_label, simulated = None, None
    for key, entry in sorted(kinds.items(), key=lambda kv: (kv[0][0] != "linear", str(kv[0][1:]))):
        op, fmt, scheme, n, k, experts, scale_kind = key
        decision = select(
            fmt,
            op,
            act_dtype,
            scheme,
            n=n,
            k=k,
            experts=experts,
            scale_kind=scale_kind,
            device=profile_or_device,
            settings=settings,
            policy=policy,
        )
        device_label, simulated = decision.device.label(), decision.device.simulated
        layers.append(_kind_row(key, entry["names"], decision, text.get("num_experts_per_tok")))
    return {
        "model": str(p),
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
        "quantization": None if quant is None else {"producer": quant.producer},
        "device": device_label,
        "simulated": simulated,
        "act_dtype": str(act_dtype).replace("torch.", ""),
        "layers": layers,
        "unquantized": {"count": len(unquantized), "examples": unquantized[:5]},
    }


def _short(reason: str, width: int = 90) -> str:
    """The gist of a decision's reason: what runs, without the policy preamble and details."""
    text = reason.split(": ", 1)[-1].split(" [", 1)[0]
    return text if len(text) <= width else text[: width - 3] + "..."


def render_description(d: Mapping[str, Any], *, verbose: bool = False) -> str:
    """Text for :func:`describe_model`'s dict: one line per layer kind with the backend and the
    gist of why; ``verbose`` adds the full reason and one line per rejected backend."""
    arch = ", ".join(d.get("architectures") or []) or d.get("model_type") or "?"
    producer = (d.get("quantization") or {}).get("producer", "no quantization config")
    lines = [f"Model {d['model']} ({arch}), {producer} checkpoint, activations {d['act_dtype']}"]
    if d["device"]:
        lines.append(f"Device {d['device']}")
    for r in d["layers"]:
        if r["op"] == "moe":
            shape = f"E={r['experts']} I={r['n']} H={r['k']}"
        else:
            shape = f"N={r['n']} K={r['k']}"
        fp8 = f" ({r['scale_kind']} scales)" if r["scale_kind"] else ""
        reason = r["reason"] if verbose else _short(r["reason"])
        lines.append(
            f"  {r['op']:<6} {r['format']} {r['scheme_label']}{fp8} {shape} x{r['count']}"
            f" -> {r['backend']}: {reason}"
        )
        if r.get("kernels"):
            spans = (f"{m_span(k['m_min'], k['m_max'])}: {k['family']}" for k in r["kernels"])
            lines.append("      " + "; ".join(spans))
        if verbose:
            lines += [f"      not {c['backend']}: {c['reason']}" for c in r["rejected"]]
    if not d["layers"]:
        lines.append("  no quantized layers found")
    u = d["unquantized"]
    if u["count"]:
        lines.append(
            f"  float (unquantized) linears: {u['count']}, e.g. {', '.join(u['examples'])}"
        )
    return "\n".join(lines)
