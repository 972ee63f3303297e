"""A HF causal LM's decode step captured in a CUDA graph, as an engine runs it.

In eager ``generate`` every decode step pays the host time of every module call; a CUDA graph
of the step pays one launch. :func:`capture_decode` captures the one-token step of ``model``
(forward on a ``StaticCache`` at the position held on the device, greedy arg-max, position + 1)
for one batch size, once; :meth:`DecodeGraph.generate` then runs the prompt eagerly (prefill)
and replays the graph once per new token:

    graph = capture_decode(model, batch_size=1, max_len=2048)
    out = graph.generate(input_ids, max_new_tokens=128)  # [batch, prompt + 128] greedy tokens

The step reads the model's weights in place (quantized layers' buffers are marked static), and
nothing in it synchronizes with the host. Greedy only, no early stop at EOS (every sequence
gets ``max_new_tokens`` tokens; cut at EOS afterwards if you need to); one batch size per
graph. The tokens equal those of the same step run eagerly (``capture=False``), which the
tests check. Needs transformers' ``StaticCache`` and a model whose forward takes
``position_ids`` and ``cache_position`` (Llama, Qwen, Mistral and the like).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from quantdispatch.errors import ConfigurationError, InputError, format_error

__all__ = ["DecodeGraph", "capture_decode"]


class DecodeGraph:
    """Greedy decode with the one-token step in a CUDA graph (captured at the first
    :meth:`generate` that needs it). ``capture=False`` (and on the CPU) runs the same step
    eagerly: the reference the graph's tokens are checked against."""

    def __init__(self, model: Any, batch_size: int, max_len: int, *, capture: bool = True):
        from transformers import StaticCache

        if batch_size < 1 or max_len < 2:
            raise ConfigurationError(
                format_error(
                    f"batch_size={batch_size}, max_len={max_len}",
                    "a decode graph holds at least one sequence of at least 2 tokens",
                    "pass batch_size >= 1 and max_len >= prompt length + new tokens",
                )
            )
        self.model, self.batch_size, self.max_len = model, batch_size, max_len
        self.device = next(model.parameters()).device
        self.capture = capture and self.device.type == "cuda"
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self._tok = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)
        self._pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        # transformers renames past_key_values to cache; take the name this version accepts
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # positions as tensors: no host sync inside the captured step
        out = self.model(
            input_ids=ids, position_ids=pos.view(1, -1), cache_position=pos, use_cache=True,
            **{self._cache_kw: self.cache},
        )  # fmt: skip
        return out.logits[:, -1:].argmax(-1)

    def _step(self) -> None:
        self._tok.copy_(self._forward(self._tok, self._pos))
        self._pos.add_(1)

    def _prefill(self, ids: torch.Tensor) -> None:
        self.cache.reset()
        p = ids.shape[1]
        self._tok.copy_(self._forward(ids, torch.arange(p, device=self.device)))
        self._pos.fill_(p)

    def _capture(self, ids: torch.Tensor) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up off the capture: lazy allocations, first launches
                self._step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """``input_ids`` [batch_size, prompt] followed by ``max_new_tokens`` greedy tokens."""
        self.prefill(input_ids, max_new_tokens)
        toks = [self._tok.clone()]
        for _ in range(max_new_tokens - 1):
            self.step()
            toks.append(self._tok.clone())
        return torch.cat([input_ids.to(self.device), *toks], dim=1)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, max_new_tokens: int = 2) -> torch.Tensor:
        """Run the prompt (eagerly) into a reset cache; returns the first new token [batch, 1]
        (a view that the next :meth:`step` overwrites). Captures the step first if needed."""
        self._check(input_ids, max_new_tokens)
        ids = input_ids.to(self.device)
        if self.capture and self.graph is None and max_new_tokens > 1:
            self._prefill(ids)
            self._capture(ids)  # the warm-up and capture advanced the cache: prefill again
        self._prefill(ids)
        return self._tok

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """One decode step (a graph replay once captured): the next token [batch, 1] (a view
        the next step overwrites). Call :meth:`prefill` first; nothing checks the cache's
        length here (``max_len`` bounds prompt + steps)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
        return self._tok

    def _check(self, input_ids: torch.Tensor, n: int) -> None:
        if (
            not isinstance(input_ids, torch.Tensor)
            or input_ids.dim() != 2
            or input_ids.shape[0] != self.batch_size
            or input_ids.dtype not in (torch.int32, torch.int64)
        ):
            got = (
                f"{input_ids.dtype} {tuple(input_ids.shape)}"
                if isinstance(input_ids, torch.Tensor)
                else type(input_ids).__name__
            )
            raise InputError(
                format_error(
                    f"input_ids is {got}",
                    f"this graph decodes [batch_size={self.batch_size}, prompt] token ids",
                    "pass the prompt ids for this batch size (capture another graph for others)",
                )
            )
        if n < 1 or input_ids.shape[1] + n > self.max_len:
            raise InputError(
                format_error(
                    f"prompt of {input_ids.shape[1]} tokens + max_new_tokens={n}",
                    f"the static cache holds max_len={self.max_len} tokens; at least one new",
                    "capture with a larger max_len or ask for fewer tokens",
                )
            )


def capture_decode(
    model: Any, batch_size: int, max_len: int, *, capture: bool = True
) -> DecodeGraph:
    """``model``'s greedy decode step for ``batch_size`` sequences of up to ``max_len`` tokens,
    captured in a CUDA graph at the first :meth:`DecodeGraph.generate` (module doc)."""
    return DecodeGraph(model, batch_size, max_len, capture=capture)
