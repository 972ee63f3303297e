"""The bound tiled linears' shared call (the bound call path of the checkpoint layout's
weight-only kernels): check x, allocate the output, launch the plan of its M."""

from __future__ import annotations

import torch

from quantdispatch.kernels.common import checks
from quantdispatch.kernels.common.checks import check_activation
from quantdispatch.kernels.common.launch import Launcher

__all__ = ["MAX_PLANS", "VARYING", "BoundTiledLinear"]

_16_BIT = (torch.float16, torch.bfloat16)
#: Plans kept per bound weight (one per distinct M seen; cleared past this).
MAX_PLANS = 4096


class BoundTiledLinear:
    """What the checkpoint layout's bound linears share (:class:`Fp4Linear`,
    :class:`..fp8.Fp8Linear`): a call checks x, allocates the output and launches the plan of
    its M and dtype (made once by the subclass's ``_plan``: a launcher taking x, out, M and the
    row strides, and its grid)."""

    k: int
    n: int
    where: str
    _plans: dict[tuple[int, torch.dtype], tuple[Launcher, tuple[int, ...]]]

    def _plan(self, m: int, dtype: torch.dtype) -> tuple[Launcher, tuple[int, ...]]:
        raise NotImplementedError

    def _keep(self, m: int, dtype: torch.dtype, plan: tuple[Launcher, tuple[int, ...]]):  # type: ignore[no-untyped-def]
        if len(self._plans) > MAX_PLANS:
            self._plans.clear()
        self._plans[(m, dtype)] = plan
        return plan

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.k or x.dtype not in _16_BIT:
            x = check_activation(x, self.k, self.where)
        elif x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        out = checks.empty_output(m, self.n, x.dtype, x.device)
        if m == 0 or self.n == 0:
            return out
        plan = self._plans.get((m, x.dtype))
        if plan is None:
            plan = self._plan(m, x.dtype)
        launcher, grid = plan
        launcher(grid, x, out, m, x.stride(0), out.stride(0))
        return out


#: The per-call arguments of a bound tiled linear's kernels (absent tensors are bound to a
#: placeholder the kernel never reads).
VARYING = ("x_ptr", "out_ptr", "M", "stride_xm", "stride_om")


