"""Host-side checks and helpers the kernel wrappers share: activations, biases, one device, the
checkpoint FP4 / FP8 weights of the linear kernels, the routing inputs of a MoE call; the
buffers a call allocates (tests swap in poisoned ones); whether Triton runs its CPU
interpreter.
"""

from __future__ import annotations

import torch

from quantdispatch.capability import SM80_PLUS
from quantdispatch.errors import InputError, WeightFormatError, format_error
from quantdispatch.formats import SCALE_GROUP_SIZES
from quantdispatch.kernels.common.device_facts import device_facts
from quantdispatch.kernels.common.interpreter import interpreting

__all__ = [
    "SCALE_GROUP",
    "check_activation",
    "check_bias",
    "check_fp4_weights",
    "check_fp8_weights",
    "check_moe_call",
    "check_native_call",
    "check_same_device",
    "empty",
    "empty_output",
    "interpreting",
    "rows_aligned",
]

#: Elements per block scale, by the scale format of an FP4 weight (NVFP4 e4m3, MXFP4 e8m0).
SCALE_GROUP = SCALE_GROUP_SIZES


def empty_output(m: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The only allocation of a call. Tests replace it to hand out NaN-poisoned buffers."""
    return torch.empty((m, n), dtype=dtype, device=device)


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a MoE call allocates comes from here (tests swap in poisoned buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


def check_activation(x: torch.Tensor, k: int, where: str) -> torch.Tensor:
    """Shared activation checks of the weight-only wrappers; returns x with unit K stride."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise InputError(
            format_error(
                f"{where}: x has shape {shape}",
                "x must be 2-D [M, K]",
                "flatten leading dims first (x.reshape(-1, K))",
            )
        )
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise InputError(
            format_error(
                f"{where}: x dtype is {x.dtype}",
                "activations must be float16 or bfloat16",
                "cast x with x.to(torch.bfloat16) (or float16 before SM80)",
            )
        )
    if x.shape[1] != k:
        raise InputError(
            format_error(
                f"{where}: x has K={x.shape[1]} but the weight has K={k}",
                "x.shape[1] must equal the weight's in-features",
                "pass the activation that belongs to this layer",
            )
        )
    if x.device.type != "cuda" and not interpreting():
        raise InputError(
            format_error(
                f"{where}: x is on {x.device}",
                "the Triton kernels run on CUDA devices",
                "move the layer and x to a GPU (or use the reference backend on CPU)",
            )
        )
    if x.device.type == "cuda" and x.dtype == torch.bfloat16:
        facts = device_facts(x.device)
        name, cap = facts.name, facts.capability or (0, 0)
        if cap not in SM80_PLUS:
            raise InputError(
                format_error(
                    f"{where}: bfloat16 activations on {name} (SM{cap[0]}{cap[1]})",
                    "bfloat16 tensor-core math needs SM80 or newer",
                    "run this GPU with float16 activations",
                )
            )
    return x if x.stride(1) == 1 else x.contiguous()


def check_same_device(x: torch.Tensor, where: str, **tensors: torch.Tensor | None) -> None:
    """Every given tensor must live on x's device (no silent cross-device copies)."""
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise InputError(
                format_error(
                    f"{where}: {name} is on {t.device} but x is on {x.device}",
                    "all operands must be on one device",
                    f"move {name} to {x.device} at load time",
                )
            )


def check_bias(bias: torch.Tensor | None, n: int, where: str) -> None:
    """Bias is optional, [N], and any float dtype (it is added in fp32)."""
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or not bias.is_floating_point()):
        raise InputError(
            format_error(
                f"{where}: bias has shape {tuple(bias.shape)} and dtype {bias.dtype}",
                f"bias must be a 1-D float tensor of N={n} elements",
                "pass the layer's own bias",
            )
        )


def rows_aligned(t: torch.Tensor) -> bool:
    """8-byte code loads per row: rows 16-byte aligned (data pointer and row strides)."""
    return t.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in t.stride()[:-1])


def check_fp4_weights(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor | None,
    scale_format: str,
    k: int,
) -> torch.Tensor:
    """Validate the checkpoint tensors; returns the block scale viewed as uint8 codes."""
    where = "fp4_linear"
    if scale_format not in SCALE_GROUP:
        raise WeightFormatError(
            format_error(
                f"{where}: scale_format={scale_format!r}",
                "it must be 'e4m3' (NVFP4) or 'e8m0' (MXFP4)",
                "pass the format of the checkpoint's block scales",
            )
        )
    group = SCALE_GROUP[scale_format]
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.stride(1) != 1:
        raise WeightFormatError(
            format_error(
                f"{where}: packed is {packed.dtype} {tuple(packed.shape)} "
                f"strides {packed.stride()}",
                "packed FP4 weights are uint8 [N, K/2] with contiguous rows",
                "load the checkpoint's packed weight unchanged (.contiguous() once at load)",
            )
        )
    n = packed.shape[0]
    if k % group != 0:
        raise InputError(
            format_error(
                f"{where}: K={k}",
                f"K must be a multiple of the group size {group}",
                "pad the layer's in-features to the group size when quantizing",
            )
        )
    want_dtype = (torch.uint8, torch.float8_e4m3fn) if scale_format == "e4m3" else (torch.uint8,)
    if (
        block_scale.dtype not in want_dtype
        or tuple(block_scale.shape) != (n, k // group)
        or block_scale.stride(1) != 1
    ):
        raise WeightFormatError(
            format_error(
                f"{where}: block_scale is {block_scale.dtype} {tuple(block_scale.shape)}",
                f"{scale_format} block scales are {' or '.join(map(str, want_dtype))} "
                f"[N, K/{group}] = [{n}, {k // group}] with contiguous rows",
                "pass the checkpoint's block scales for this weight",
            )
        )
    if scale_format == "e4m3":
        if global_scale is None or global_scale.numel() != 1 or global_scale.dtype != torch.float32:
            raise WeightFormatError(
                format_error(
                    f"{where}: global_scale is "
                    + (
                        "None"
                        if global_scale is None
                        else f"{global_scale.dtype} {tuple(global_scale.shape)}"
                    ),
                    "NVFP4 needs a one-element float32 multiplier on the device (W = e2m1 * s * g)",
                    "pass the per-tensor scale (ModelOpt weight_scale_2, or 1/weight_global_scale)",
                )
            )
    elif global_scale is not None and (
        global_scale.numel() != 1 or global_scale.dtype != torch.float32
    ):
        raise WeightFormatError(
            format_error(
                f"{where}: global_scale is {global_scale.dtype} {tuple(global_scale.shape)} "
                "with scale_format='e8m0'",
                "MXFP4 takes no per-tensor scale, or the one-element float32 factor of "
                "rebase_mx_scales_for_fp16",
                "pass global_scale=None for checkpoint MXFP4 scales",
            )
        )
    return block_scale.view(torch.uint8)


def check_fp8_weights(
    weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None, k: int
) -> tuple[torch.Tensor, int, tuple[int, int]]:
    """Validate weight/scale; returns (uint8 weight view, scale kind, block size or (1, 1))."""
    where = "fp8_weight_only_linear"
    if (
        weight.dtype not in (torch.float8_e4m3fn, torch.uint8)
        or weight.dim() != 2
        or (weight.stride(1) != 1)
    ):
        raise WeightFormatError(
            format_error(
                f"{where}: weight is {weight.dtype} {tuple(weight.shape)} "
                f"strides {weight.stride()}",
                "FP8 weights are float8_e4m3fn (or its uint8 view) [N, K] with contiguous rows",
                "pass the checkpoint weight unchanged (.contiguous() once at load)",
            )
        )
    n = weight.shape[0]
    if scale.dtype != torch.float32:
        raise WeightFormatError(
            format_error(
                f"{where}: scale dtype is {scale.dtype}",
                "FP8 weight scales are float32",
                "convert the scale once at load: scale.float()",
            )
        )
    kind = scale.dim()
    if kind == 0:
        bs = (1, 1)
    elif kind == 1:
        if scale.shape[0] != n:
            raise WeightFormatError(
                format_error(
                    f"{where}: per-channel scale has {scale.shape[0]} entries",
                    f"it needs N={n}",
                    "pass the [N] weight scale of this layer",
                )
            )
        bs = (1, 1)
    elif kind == 2:
        if block_size is None or len(block_size) != 2 or min(block_size) <= 0:
            raise WeightFormatError(
                format_error(
                    f"{where}: 2-D scale {tuple(scale.shape)} with block_size={block_size!r}",
                    "block scales need block_size=(block_n, block_k)",
                    "pass the checkpoint's weight_block_size, e.g. (128, 128)",
                )
            )
        bn, bk = int(block_size[0]), int(block_size[1])
        want = (-(-n // bn), -(-k // bk))
        if tuple(scale.shape) != want:
            raise WeightFormatError(
                format_error(
                    f"{where}: block scale shape {tuple(scale.shape)}",
                    f"with block_size {(bn, bk)} it must be "
                    f"[ceil(N/{bn}), ceil(K/{bk})] = {list(want)}",
                    "pass the scale that belongs to this weight and block size",
                )
            )
        if bk % 16 != 0:
            raise WeightFormatError(
                format_error(
                    f"{where}: block_k={bk}",
                    "block_k must be a multiple of 16 (the MMA K step)",
                    "use the reference backend for this checkpoint",
                )
            )
        bs = (bn, bk)
    else:
        raise WeightFormatError(
            format_error(
                f"{where}: scale has {kind} dims",
                "0 (tensor), 1 (channel) or 2 (block)",
                "pass the checkpoint's weight scale",
            )
        )
    return weight.view(torch.uint8), kind, bs


def _fail(what: str, rule: str, fix: str, exc: type[Exception] = WeightFormatError) -> None:
    raise exc(format_error(f"fused_moe: {what}", rule, fix))


def check_moe_call(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: int,
    n13: int,
    n2: int,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> int:
    """The checks every MoE kernel entry shares (x already checked as [M, H] 16-bit): x on a
    GPU, routing shapes and dtypes, biases, one device. Returns top_k."""
    if x.device.type != "cuda" and not interpreting():
        _fail(
            f"x is on {x.device}",
            "the Triton kernels run on CUDA devices",
            "use the reference backend on CPU",
            InputError,
        )
    m = x.shape[0]
    int_ids = (torch.int32, torch.int64)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m or topk_ids.dtype not in int_ids:
        _fail(
            f"topk_ids is {topk_ids.dtype} {tuple(topk_ids.shape)}",
            f"topk_ids are int32/int64 [M={m}, top_k]",
            "pass the router's top-k expert ids",
            InputError,
        )
    top_k = topk_ids.shape[1]
    if tuple(topk_weights.shape) != (m, top_k) or topk_weights.dtype != torch.float32:
        _fail(
            f"topk_weights is {topk_weights.dtype} {tuple(topk_weights.shape)}",
            f"topk_weights are float32 [M, top_k] = [{m}, {top_k}]",
            "pass the router's final weights as float32",
            InputError,
        )
    for name, bias, n in (("w13_bias", w13_bias, n13), ("w2_bias", w2_bias, n2)):
        if bias is not None and (tuple(bias.shape) != (experts, n) or bias.dtype != torch.float32):
            _fail(
                f"{name} is {bias.dtype} {tuple(bias.shape)}",
                f"expert biases are float32 [E, N] = [{experts}, {n}]",
                "stack them as float32",
            )
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w13", w13),
                    ("w2", w2), ("w13_bias", w13_bias), ("w2_bias", w2_bias)):  # fmt: skip
        if t is not None and t.device != x.device:
            _fail(f"{name} is on {t.device}, x on {x.device}", "one device", "", InputError)
    return top_k


def check_native_call(
    x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None, where: str
) -> None:
    """The activation and bias checks of the native (torch._scaled_mm) wrappers: x a 2-D
    bf16/fp16 [M, K] tensor with this weight's K, bias [N] on x's device."""
    if (
        not isinstance(x, torch.Tensor)
        or x.dim() != 2
        or x.dtype
        not in (
            torch.bfloat16,
            torch.float16,
        )
    ):
        raise InputError(
            format_error(
                f"{where}: x is {getattr(x, 'dtype', type(x).__name__)} "
                f"{tuple(getattr(x, 'shape', ()))}",
                "x must be a 2-D bfloat16/float16 [M, K] tensor",
                "flatten and cast x first",
            )
        )
    if x.shape[1] != k:
        raise InputError(
            format_error(
                f"{where}: x has K={x.shape[1]}, the weight has K={k}",
                "they must match",
                "pass this layer's activation",
            )
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or bias.device != x.device):
        raise InputError(
            format_error(
                f"{where}: bias {tuple(bias.shape)} on {bias.device}",
                f"bias must be [N={n}] on x's device ({x.device})",
                "pass the layer's bias",
            )
        )
