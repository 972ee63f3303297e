"""Launching a Triton kernel with its fixed arguments bound once: the bound call path's launch.

``kernel[grid](...)`` re-derives on every call what a layer's kernel never changes: it binds
every argument to the signature, specializes each one (dtype, 16-byte alignment, ``== 1``,
divisibility by 16), renders the compile options as a string to look the compiled kernel up,
then launches. A decode step calls hundreds of such launches, and that host time is the step's
time in eager mode. :class:`Launcher` keeps the fixed arguments (weights, scales, shapes, the
constexprs and launch options) in an argument list made once; a call passes only the varying
ones. The first call with a new specialization goes through ``kernel[grid]`` (Triton compiles or
finds the kernel and returns it); later calls with the same specialization, from this launcher
or any other of the same kernel, fixed-argument specialization and options, launch that
compiled kernel directly. :func:`launch` does the same for call sites that bind nothing.

The key a call is matched by is never coarser than Triton's: per tensor its dtype and its
address modulo 16, per int whether it is 1, its value modulo 16 and its integer width, per host
tensor descriptor all of those of its base, shape and strides plus its block shape; anything
else (unknown types) takes Triton's own path every time. The direct launch is used only where
it has been read against Triton's launcher convention (:data:`DIRECT_TRITON`), never in the
interpreter, and never while launch hooks (profilers) are installed: then every call goes
through ``kernel[grid]``, the same kernel either way.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence

import torch
import triton

__all__ = ["DIRECT_TRITON", "Launcher", "direct_launch_available", "launch"]

#: Triton versions whose ``CompiledKernel.run`` takes (grid x3, stream, function, packed
#: metadata, launch metadata, enter hook, exit hook, every argument in signature order):
#: read in the sources of 3.4 through 3.9. Others launch through ``kernel[grid]`` only.
DIRECT_TRITON = ((3, 4), (4, 0))

_I32 = 2**31
_U64 = 2**63
#: Compiled kernels found by a first launch, per (kernel, fixed-argument key, options,
#: device) and then per varying-argument key: (launcher, CUfunction, packed metadata).
_COMPILED: dict[tuple[object, ...], dict[tuple[object, ...], tuple[object, object, object]]] = {}
_MAX_ENTRIES = 64  # specializations kept per fixed key


def _version() -> tuple[int, int]:
    parts = triton.__version__.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


@functools.cache
def direct_launch_available() -> bool:
    """Whether compiled kernels may be launched directly here (module doc)."""
    low, high = DIRECT_TRITON
    return low <= _version() < high and torch.cuda.is_available()


def _runtime_knobs():  # type: ignore[no-untyped-def]
    """Triton's runtime knobs, where its launch hooks live (None where this Triton has none)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs.runtime


_RUNTIME = _runtime_knobs()


def _idle(hook: object) -> bool:
    """No launch hook installed (a profiler's hook makes every launch go through Triton)."""
    return hook is None or not getattr(hook, "calls", True)


def _spec(value: object) -> object:
    """What Triton specializes a launch argument on, or a marker that forces its own path."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() & 15
    kind = type(value)
    if kind is int:
        return value == 1, value & 15, -_I32 <= value < _I32, value >= _U64  # type: ignore[operator]
    if kind is bool:
        return kind, value  # by value: never coarser than Triton, whatever it does with bools
    if kind is float or value is None:
        return kind
    if kind.__name__ == "TensorDescriptor" and isinstance(
        getattr(value, "base", None), torch.Tensor
    ):
        return _descriptor_spec(value)
    return _OPAQUE


def _descriptor_spec(desc: object) -> object:
    """A host tensor descriptor by everything Triton could specialize it on (its base's dtype
    and alignment, block shape, padding, and each shape and stride value's width, ``== 1`` and
    modulo 16): never coarser than Triton's own key."""
    base: torch.Tensor = desc.base  # type: ignore[attr-defined]
    ints = tuple(_spec(int(v)) for v in (*desc.shape, *desc.strides))  # type: ignore[attr-defined]
    block = tuple(desc.block_shape)  # type: ignore[attr-defined]
    return "desc", base.dtype, base.data_ptr() & 15, block, getattr(desc, "padding", None), ints


class _Opaque:
    def __repr__(self) -> str:
        return "<opaque>"


_OPAQUE = _Opaque()


def _fixed_key(fn: object, fixed: Mapping[str, object], options: Mapping[str, object]):  # type: ignore[no-untyped-def]
    """The shared-cache key of a launcher's fixed part (None: not cacheable): tensors and
    descriptors by their specialization, everything else (constexprs, sizes) by value."""
    parts = []
    for name, value in fixed.items():
        tensorish = isinstance(value, torch.Tensor) or type(value).__name__ == "TensorDescriptor"
        parts.append((name, _spec(value) if tensorish else value))
    key = (id(fn), tuple(parts), tuple(sorted(options.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


class Launcher:
    """One Triton kernel with its fixed arguments bound.

    ``fixed``: every argument that does not change between calls, by name (constexprs
    included; parameters with defaults may be left out); ``varying``: the names of the others,
    passed positionally to :meth:`__call__` in this order; ``options``: launch options
    (``num_warps``, ``num_stages``, ``maxnreg``, ``launch_pdl``...). The caller keeps the fixed
    tensors alive and unchanged in place (a layer's prepared buffers)."""

    __slots__ = (
        "_cache", "_device", "_fixed", "_fn", "_options", "_positions", "_template", "_varying",
    )  # fmt: skip

    def __init__(
        self,
        fn: object,
        varying: Sequence[str],
        fixed: Mapping[str, object],
        options: Mapping[str, object] | None = None,
    ) -> None:
        self._fn = fn
        self._varying = tuple(varying)
        self._options = dict(options or {})
        self._cache: dict[tuple[object, ...], tuple[object, object, object]] | None = None
        self._device = -1
        try:
            names, defaults = _signature(fn)
        except (TypeError, ValueError):  # not a Python kernel (a stand-in): Triton's path only
            self._template, self._positions, self._fixed = [], (), dict(fixed)
            return
        unknown = (set(fixed) | set(self._varying)) - set(names)
        if unknown:
            raise TypeError(f"{_name(fn)} has no parameter {sorted(unknown)}")
        template: list[object] = []
        for name in names:
            if name in fixed:
                template.append(fixed[name])
            elif name in self._varying:
                template.append(None)
            elif name in defaults:
                template.append(defaults[name])
            else:
                raise TypeError(f"{_name(fn)}: no value bound for parameter {name!r}")
        self._template = template
        self._positions = tuple(names.index(v) for v in self._varying)
        self._fixed = {n: v for n, v in zip(names, template, strict=True) if n not in self._varying}
        if type(fn).__name__ == "JITFunction" and direct_launch_available():
            key = _fixed_key(fn, self._fixed, self._options)
            if key is not None:
                self._device = _device_of(self._fixed.values())
                _KEEP.setdefault(id(fn), fn)  # the key's id stays this kernel's
                self._cache = _COMPILED.setdefault((*key, self._device), {})

    def __call__(self, grid: tuple[int, ...], *values: object) -> None:
        """Launch on ``grid`` with the varying arguments ``values``."""
        cache = self._cache
        if cache is None:
            self._slow(grid, values, None)
            return
        key = tuple(map(_spec, values))
        entry = cache.get(key)
        rt = _RUNTIME
        if entry is not None and (
            rt is None or (_idle(rt.launch_enter_hook) and _idle(rt.launch_exit_hook))
        ):
            device = torch._C._cuda_getDevice()
            if device == self._device:
                args = self._template.copy()
                for pos, v in zip(self._positions, values):  # noqa: B905 (same length)
                    args[pos] = v
                run, function, packed = entry
                n = len(grid)
                run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                    torch._C._cuda_getCurrentRawStream(device), function, packed, None, None,
                    None, *args)  # fmt: skip
                return
        self._slow(grid, values, key)

    def _slow(self, grid: tuple[int, ...], values: tuple[object, ...], key: object) -> None:
        """Triton's own launch; remembers the compiled kernel where a direct launch may reuse
        it."""
        kwargs = dict(zip(self._varying, values, strict=True))
        kernel = self._fn[grid](**self._fixed, **kwargs, **self._options)  # type: ignore[index]
        cache = self._cache
        if cache is None or key is None or _OPAQUE in key:  # type: ignore[operator]
            return
        run, function = getattr(kernel, "run", None), getattr(kernel, "function", None)
        if run is None or function is None or torch._C._cuda_getDevice() != self._device:
            return
        if len(cache) >= _MAX_ENTRIES:
            cache.clear()
        cache[key] = (run, function, kernel.packed_metadata)  # type: ignore[index]


def _device_of(values: object) -> int:
    """The CUDA device of the first CUDA tensor among ``values``, else the current one."""
    for v in values:  # type: ignore[attr-defined]
        if isinstance(v, torch.Tensor) and v.is_cuda:
            return v.get_device()
    return torch.cuda.current_device()


def launch(fn: object, grid: tuple[int, ...], /, *args: object, **kwargs: object) -> None:
    """``fn[grid](*args, **kwargs)`` through a :class:`Launcher` kept per kernel and per set of
    constexpr values and launch options: for launch sites whose arguments all change per call
    (activations, routing buffers), where no object can hold them. Every runtime argument is
    matched per call, so it saves less than a bound :class:`Launcher`, but skips Triton's
    binding and option rendering."""
    split = _split(fn)
    if split is None:
        fn[grid](*args, **kwargs)  # type: ignore[index]
        return
    names, constexprs, runtime = split
    values = dict(zip(names, args, strict=False))
    values.update(kwargs)
    try:
        key = (
            id(fn),
            tuple(values.get(n, _MISSING) for n in constexprs),
            tuple(sorted((k, v) for k, v in values.items() if k not in names)),  # options
            torch._C._cuda_getDevice(),
        )
        launcher = _LAUNCHERS.get(key)
    except TypeError:  # an unhashable constexpr or option: Triton's own path
        fn[grid](*args, **kwargs)  # type: ignore[index]
        return
    if launcher is None:
        options = {k: v for k, v in values.items() if k not in names}
        fixed = {n: values[n] for n in constexprs if n in values}
        launcher = Launcher(fn, runtime, fixed, options)
        if len(_LAUNCHERS) >= 4096:
            _LAUNCHERS.clear()
        _LAUNCHERS[key] = launcher
    _, defaults = _signature(fn)
    launcher(grid, *(values[n] if n in values else defaults[n] for n in runtime))


_MISSING = _Opaque()
_LAUNCHERS: dict[tuple[object, ...], Launcher] = {}
#: Kernels whose id is part of a cache key, kept alive so the id stays theirs.
_KEEP: dict[int, object] = {}
_SPLITS: dict[int, tuple[tuple[str, ...], ...] | None] = {}


def _split(fn: object) -> tuple[tuple[str, ...], ...] | None:
    """(parameter names, constexpr names, runtime names) of a JIT kernel; None for anything
    else (the interpreter's kernels, stand-ins, a Triton without the direct launch)."""
    found = _SPLITS.get(id(fn), _MISSING)
    if found is not _MISSING:
        return found  # type: ignore[return-value]
    params = getattr(fn, "params", None)
    split = None
    if params is not None and direct_launch_available() and type(fn).__name__ == "JITFunction":
        names, _ = _signature(fn)
        constexprs = tuple(p.name for p in params if p.is_constexpr)
        split = (names, constexprs, tuple(n for n in names if n not in constexprs))
    _KEEP.setdefault(id(fn), fn)
    _SPLITS[id(fn)] = split
    return split


@functools.cache
def _signature_of(py_fn: object) -> tuple[tuple[str, ...], dict[str, object]]:
    params = inspect.signature(py_fn).parameters  # type: ignore[arg-type]
    names = tuple(params)
    defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    return names, defaults


def _signature(fn: object) -> tuple[tuple[str, ...], dict[str, object]]:
    """The kernel's parameter names in order and their defaults (keyed by the Python function:
    a JIT function's own hash walks its dependencies)."""
    return _signature_of(getattr(fn, "fn", fn))


def _name(fn: object) -> str:
    return getattr(getattr(fn, "fn", fn), "__name__", repr(fn))
