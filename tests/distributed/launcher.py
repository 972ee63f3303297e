"""Run a function on N local processes joined in a torch.distributed gloo group (CPU tests).

``launch(fn, world_size, *args)`` starts fresh processes (torch.multiprocessing), joins them
in a gloo group on a free localhost port, calls ``fn(rank, world_size, *args)`` in each and
raises the first child's error with its traceback; after ``timeout`` seconds every child is
killed and TimeoutError raised. ``fn`` must be importable by name (a module-level function of a
module on sys.path): the children import it.

Start method: forkserver where the platform has it, with torch (and torch._dynamo, which the
first custom-op call imports) preloaded once in the server, so each launch forks ready
processes instead of importing torch N times (seconds per process on a small CI machine);
spawn elsewhere. Either way the children are new processes, not copies of the test process.
"""

from __future__ import annotations

import socket
import sys
import time
from datetime import timedelta
from typing import Any

import torch


def gloo_skip_reason() -> str | None:
    """Why the gloo tests cannot run here, or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return "the gloo backend is not available in this torch build"
    return None


#: Imported once by the fork server, before it forks the ranks.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "quantdispatch.layers"]


def _start_method() -> str:
    import torch.multiprocessing as mp

    if sys.platform.startswith("linux") and "forkserver" in mp.get_all_start_methods():
        mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
        return "forkserver"
    return "spawn"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, fn: Any, world_size: int, port: int, timeout: float, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # N processes share the CI machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(fn: Any, world_size: int, *args: Any, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes in one gloo group."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), timeout, args),
        nprocs=world_size,
        join=False,
        start_method=_start_method(),
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{world_size} ranks of {getattr(fn, '__name__', fn)} still running after "
                    f"{timeout:.0f} s"
                )
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
