"""Marlin: FP4 weights dequantized in registers inside an engine's own compiled GEMM.

The kernels are the provider's (vLLM's extension; see marlin_providers.py for detection and
the version table); the preparation is ours (marlin_contract.py), keyed to the provider
versions it was established for, except the tile repack of the codes, which is the
provider's compiled ``gptq_marlin_repack``. Facts (docs/design/marlin.md): SM 7.5+ with fp16
activations, SM 8.0+ with bf16; NVFP4 with bf16 or fp16, MXFP4 with bf16 only (vLLM builds
no fp16 MXFP4 kernel); N, K padded with zeros to (N % 64, K % 128) or (N % 128, K % 64) and
the output sliced, so tensor-parallel shards (720 x 2880, ...) run. MoE: the provider's
grouped Marlin GEMM for both expert GEMMs (marlin_moe.py); routing and its weights are ours.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from quantdispatch.backends import marlin_providers as providers
from quantdispatch.backends.base import (
    Backend,
    BackendFacts,
    ExpertStacks,
    Layout,
    LinearBinding,
    MarlinMeta,
    MoeCall,
    PreparedMoe,
    PreparedWeight,
    op_view,
)
from quantdispatch.backends.marlin_contract import (
    FLOAT4_E2M1F_ID,
    moe_padded_intermediate,
    padded_shape,
    prepare_linear,
)
from quantdispatch.backends.prepared import named_tensors
from quantdispatch.capability import SM75_PLUS, SM80_PLUS
from quantdispatch.errors import BackendUnavailableError, InputError, format_error
from quantdispatch.formats import get_format
from quantdispatch.request import Op, Request

if TYPE_CHECKING:
    from quantdispatch.checkpoints import QuantWeight
    from quantdispatch.device import DeviceProfile

__all__ = ["MarlinBackend", "MarlinFacts"]


def _contract_index(key: str) -> int:
    return [c.key for c in providers.CONTRACTS].index(key)


def _workspace(device: torch.device) -> torch.Tensor:
    """Zeroed int32 locks, one per thread block the kernel may launch (SMs x 4); the kernel
    leaves them zero after each call, so a layer keeps its own."""
    from quantdispatch.kernels.common.device_facts import device_facts

    sms = device_facts(device).sm_count if device.type == "cuda" else 1
    return torch.zeros(sms * 4, dtype=torch.int32, device=device)


class MarlinFacts(BackendFacts):
    """What the marlin backend runs, by the provider detected in this process."""

    name = "marlin"
    title = (
        "Marlin weight-only GEMM from the engine's own library (FP4 weights, 16-bit activations)"
    )
    supports = {"nvfp4": frozenset({Op.LINEAR, Op.MOE}), "mxfp4": frozenset({Op.LINEAR, Op.MOE})}
    implemented = {
        "nvfp4": frozenset({Op.LINEAR, Op.MOE}),
        "mxfp4": frozenset({Op.LINEAR, Op.MOE}),
    }
    provider = None  # detected by marlin_providers (package metadata or load_library)
    weight_only = True
    min_sm = (SM75_PLUS, SM80_PLUS)  # no bf16 tensor cores before Ampere

    def shape_reasons(self, request: Request) -> list[str]:
        k = request.k
        if request.op is Op.MOE:
            if k is not None and moe_padded_intermediate(1, k) is None:
                return [f"hidden size H={k} is not a multiple of 64 (Marlin MoE tiles need it)"]
            return []
        return self.group_reasons(request)

    def unsupported_reasons(self, request: Request, profile: DeviceProfile) -> list[str]:
        reasons = super().unsupported_reasons(request, profile)
        if reasons and reasons[0].startswith(f"{self.name} does not compute"):
            return reasons
        return reasons + self.provider_reasons(request)

    def provider_reasons(self, request: Request) -> list[str]:
        """Why no provider in this process runs ``request`` (empty when one does)."""
        pair = (request.format, request.act_name)
        if not any(pair in row.kernels for row in providers.CONTRACTS):
            return [
                f"no Marlin provider has {request.format} kernels for {request.act_name} "
                "activations (vLLM builds MXFP4 Marlin for bf16 only); use bf16"
            ]
        status = providers.active()
        if status is None:
            found = "; ".join(s.describe() for s in providers.statuses())
            return [f"no usable Marlin provider ({found})"]
        assert status.contract is not None
        if pair not in status.contract.kernels:
            return [
                f"{status.name} {status.version} has no {request.format} Marlin kernel for "
                f"{request.act_name} activations"
            ]
        if request.op is Op.MOE and not status.offers("moe"):
            ns, op = status.contract.ops.get("moe", ("?", "?"))
            return [
                f"{status.name} {status.version}: {ns}::{op} is not registered (load the MoE "
                f"library too: {', '.join(status.contract.libraries.get(ns, ()))})"
            ]
        return []

    def variant(self, request: Request, profile: DeviceProfile) -> str | None:
        status = providers.active()
        if status is None or status.contract is None:
            return None
        row = status.contract
        ns, op = row.ops["moe" if request.op is Op.MOE else "gemm"]
        parts = [f"{status.name} {status.version} {ns}::{op}"]
        n, k = request.n, request.k
        group = get_format(request.format).group_size
        if request.op is Op.LINEAR and n and k and group:
            np_, kp = padded_shape(n, k, group)
            grown = [f"{d} {a}->{b}" for d, a, b in (("N", n, np_), ("K", k, kp)) if a != b]
            if grown:
                parts.append(f"pads {', '.join(grown)} with zeros to Marlin's tiles")
        if request.op is Op.MOE and n and k:
            ip = moe_padded_intermediate(n, k)
            if ip is not None and ip != n:
                parts.append(f"pads I {n}->{ip} to Marlin's tiles")
        parts.append(row.gpu_verified or "contract from provider sources, not yet GPU-verified")
        return "; ".join(parts)

    def selfcheck_identity(self, profile: DeviceProfile) -> str:
        """The provider it detects itself (vLLM / sgl-kernel, not a profile field)."""
        status = providers.active()
        return f"{status.name} {status.version}" if status is not None else "no provider"


class MarlinBackend(Backend):
    """The marlin backend's life cycle: the provider's repack at load, its GEMMs per call."""

    facts = MarlinFacts()

    def _provider(self, roles: tuple[str, ...]) -> providers.ProviderStatus:
        status = providers.active()
        if status is None:
            found = "; ".join(s.describe() for s in providers.statuses())
            raise BackendUnavailableError(
                format_error(
                    f"no usable Marlin provider ({found})",
                    "the marlin backend runs a provider's compiled kernels",
                    "install vLLM from the contract table or call "
                    "quantdispatch.backends.marlin_providers.load_library(...)",
                )
            )
        providers.ensure_loaded(status, roles)
        return status

    def _repack(self, row: providers.Contract):
        op = row.op("repack")
        schema = row.schema

        def repack(words: torch.Tensor, size_k: int, size_n: int) -> torch.Tensor:
            if schema is providers.Schema.MARLIN_GEMM:
                return op(words, size_k, size_n, 4, False)
            perm = torch.empty(0, dtype=torch.int32, device=words.device)
            if schema is providers.Schema.MARLIN_GEMM_GIDX:
                return op(words, perm, size_k, size_n, 4, False)
            return op(words, perm, size_k, size_n, 4)

        return repack

    def prepare_linear(
        self, weight: QuantWeight, request: Request, options: object
    ) -> PreparedWeight:
        status = self._provider(("gemm", "repack"))
        assert status.contract is not None
        fmt = request.format
        act = request.act_dtype
        g = weight.global_scale if fmt == "nvfp4" else None  # type: ignore[union-attr]
        t = prepare_linear(
            fmt, weight.packed, weight.block_scale, g, act, self._repack(status.contract)
        )
        n, k = weight.shape
        workspace = _workspace(weight.packed.device)
        names, tensors = named_tensors(
            MarlinTensors(t.qweight, t.scales, t.global_scale, workspace)
        )
        meta = MarlinMeta(_contract_index(status.contract.key), act, n, k, t.n_pad, t.k_pad)
        return PreparedWeight(names, tensors, Layout.MARLIN, meta, out_features=n, in_features=k)

    def make_linear(self, w: LinearBinding) -> _MarlinLinear:
        return _MarlinLinear(w.tensors, w.bias, w.fmt, w.meta)

    def prepare_moe(self, stacks: ExpertStacks, request: Request) -> PreparedMoe:
        from quantdispatch.backends.marlin_moe import prepare_stack

        w13, w2, gated = stacks.w13, stacks.w2, stacks.gated
        status = self._provider(("gemm", "repack", "moe"))
        assert status.contract is not None
        fmt, act = request.format, request.act_dtype
        shards = 2 if gated else 1
        hidden = w2[0].shape[1]
        inter = w13[0].shape[1] // shards
        inter_pad = moe_padded_intermediate(inter, hidden)
        if inter_pad is None:
            raise BackendUnavailableError(
                format_error(
                    f"hidden size H={hidden} is not a multiple of 64",
                    "Marlin MoE tiles need H % 64 == 0",
                    "use the triton or reference backend for this layer",
                )
            )
        repack = self._repack(status.contract)
        s13 = prepare_stack(fmt, w13, act, repack, rows=inter_pad, k_pad=hidden, shards=shards)
        s2 = prepare_stack(fmt, w2, act, repack, rows=hidden, k_pad=inter_pad, shards=1)
        device = w13[0].device
        s13.append(_workspace(device))
        s2.append(_workspace(device))
        out_names = ["marlin_qweight", "marlin_scales"]
        out_names += ["marlin_global_scale"] if fmt == "nvfp4" else []
        key = _contract_index(status.contract.key)
        meta_out = MarlinMeta(key, act, inter, hidden, inter_pad, hidden, gated)
        return PreparedMoe(
            (*out_names, "marlin_workspace"), tuple(s13), tuple(s2), Layout.MARLIN, meta_out
        )

    def moe(self, call: MoeCall) -> torch.Tensor:
        from quantdispatch.backends.marlin_moe import run_moe

        meta, fmt, x = call.meta, call.fmt, call.x
        assert isinstance(meta, MarlinMeta), meta
        row = providers.CONTRACTS[meta.contract]
        scale_dtype = torch.float8_e4m3fn if fmt == "nvfp4" else torch.float8_e8m0fnu

        def fix(stack: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            out = list(stack)
            out[1] = out[1] if out[1].dtype == scale_dtype else out[1].view(scale_dtype)
            return out

        if x.shape[0] == 0:
            return x.new_empty(x.shape)
        return run_moe(
            row,
            x,
            call.topk_ids,
            call.topk_weights,
            fix(call.w13),
            fix(call.w2),
            call.w13_bias,
            call.w2_bias,
            call.activation,
            call.params,
            inter=meta.n,
            inter_pad=meta.n_pad,
            gated=meta.gated,
        )


class MarlinTensors(NamedTuple):
    """A Marlin linear weight's tensors, in order (the field names are the layer's buffer
    names): tile-ordered codes, scales in Marlin's encoding, NVFP4's global scale (MXFP4: none)
    and the GEMM's workspace."""

    marlin_qweight: torch.Tensor
    marlin_scales: torch.Tensor
    marlin_global_scale: torch.Tensor | None
    marlin_workspace: torch.Tensor

    @classmethod
    def from_list(cls, tensors: Sequence[torch.Tensor], fmt: str) -> MarlinTensors:
        """The op's tensor list, named, the scales viewed as the GEMM takes them."""
        scale_dtype = torch.float8_e4m3fn if fmt == "nvfp4" else torch.float8_e8m0fnu
        scales = op_view(tensors[1], scale_dtype)
        global_scale = tensors[2] if fmt == "nvfp4" else None
        return cls(tensors[0], scales, global_scale, tensors[-1])


class _MarlinLinear:
    """One Marlin weight with its provider op, scale views and global scale looked up once; a
    call pads K where needed, runs the provider GEMM and adds the bias."""

    def __init__(
        self, tensors: Sequence[torch.Tensor], bias: torch.Tensor | None, fmt: str, meta: object
    ) -> None:
        assert isinstance(meta, MarlinMeta), meta
        self.row, self.meta, self.bias = providers.CONTRACTS[meta.contract], meta, bias
        named = MarlinTensors.from_list(tensors, fmt)
        self.qweight, self.workspace = named.marlin_qweight, named.marlin_workspace
        self.scales, self.global_scale = named.marlin_scales, named.marlin_global_scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        n, k, n_pad, k_pad = meta.n, meta.k, meta.n_pad, meta.k_pad
        if x.dtype != meta.act_dtype:
            raise InputError(
                format_error(
                    f"input is {x.dtype} but the Marlin weight was prepared for {meta.act_dtype}",
                    "Marlin's NVFP4 scale encoding depends on the activation dtype",
                    "call the layer with the activation dtype it was built for",
                )
            )
        if x.shape[0] == 0:
            return x.new_empty((0, n))
        a = x if k_pad == k else torch.nn.functional.pad(x, (0, k_pad - k))
        if a.stride(-1) != 1 or a.stride(0) % 8 or a.data_ptr() % 16:
            a = a.contiguous()
        out = _gemm(
            self.row, a, self.qweight, self.scales, self.global_scale, self.workspace, n_pad, k_pad
        )
        if n_pad != n:
            out = out[:, :n]
        if self.bias is not None:
            out = (out.float() + self.bias.float()).to(x.dtype)
        return out.contiguous()


def _gemm(
    row: providers.Contract,
    a: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    workspace: torch.Tensor,
    n_pad: int,
    k_pad: int,
) -> torch.Tensor:
    """One provider GEMM call, arguments in the order its schema takes them."""
    op = row.op("gemm")
    m = a.shape[0]
    sizes = (FLOAT4_E2M1F_ID, m, n_pad, k_pad)
    flags = (False, True, False)  # no atomic add, fp32 reduce, no float zero points
    if row.schema is providers.Schema.MARLIN_GEMM:
        return op(
            a, None, qweight, None, scales, None, global_scale, None, workspace, *sizes, *flags
        )
    if row.schema is providers.Schema.MARLIN_GEMM_GIDX:
        head = (a, None, qweight, None, scales, None, global_scale, None, None, None, workspace)
        return op(*head, *sizes, True, *flags)
    head = (a, None, qweight, scales, global_scale, None, None, None, workspace)
    return op(*head, *sizes, True, *flags)
