"""The MoE activations in fp32 as one ``@triton.jit`` helper: the gate/up epilogues of both
layouts and the dequantize path's activation pass call it (codes and definitions:
:mod:`.moe_activations`; torch definitions: :mod:`quantdispatch.moe.activations`).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["apply_activation"]


@triton.jit
def apply_activation(g, u, alpha, limit, ACT: tl.constexpr):
    """The activations of :mod:`.moe_activations` in fp32.

    Codes: 0 silu, 1 gelu_tanh, 2 swiglu_oai, 3 relu2, 4 silu.
    """
    if ACT == 0:
        h = g * tl.sigmoid(g) * u
    elif ACT == 1:  # 0.5 * (1 + tanh(z)) = sigmoid(2z)
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        h = g * tl.sigmoid(2.0 * inner) * u
    elif ACT == 2:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        h = gc * tl.sigmoid(alpha * gc) * (uc + 1.0)
    elif ACT == 3:
        r = tl.maximum(g, 0.0)
        h = r * r
    else:
        h = g * tl.sigmoid(g)
    return h
