"""load_model from several threads at once, while another thread builds ordinary modules: no
thread sees another's meta device or dtype, and nothing process-wide is left changed."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from hf_models import float_model, make_config, write_checkpoint

from quantdispatch.integrations.transformers import load_model

ROUNDS = 10
LOADERS = 4


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-threads")
    config = make_config("llama", num_hidden_layers=1)
    write_checkpoint(float_model(config), path, arch="llama")
    return path


def test_loads_in_threads_leave_other_modules_and_globals_alone(tiny_ckpt):
    register_parameter = nn.Module.register_parameter
    default_dtype = torch.get_default_dtype()
    reference = load_model(tiny_ckpt, device="cpu", attn_implementation="eager")
    expected = {k: v.clone() for k, v in reference.state_dict().items()}
    problems: list[str] = []

    def loader() -> None:
        try:
            model = load_model(tiny_ckpt, device="cpu", attn_implementation="eager")
        except Exception as exc:  # reported below, with the thread's view
            problems.append(f"load raised {type(exc).__name__}: {exc}")
            return
        state = model.state_dict()
        meta = [n for n, t in state.items() if t.is_meta]
        if meta:
            problems.append(f"loaded model has meta tensors {meta[:3]}")
        for name, value in expected.items():
            got = state[name]
            if got.dtype != value.dtype or not torch.equal(got, value):
                problems.append(f"{name} differs from a load in one thread")
                break

    def builder(stop: threading.Event) -> None:
        while not stop.is_set():
            linear = nn.Linear(8, 8)
            if linear.weight.is_meta or linear.weight.dtype != default_dtype:
                problems.append(
                    f"an unrelated nn.Linear got a {linear.weight.dtype} weight on "
                    f"{linear.weight.device}"
                )
                return

    for _ in range(ROUNDS):
        stop = threading.Event()
        threads = [threading.Thread(target=loader) for _ in range(LOADERS)]
        other = threading.Thread(target=builder, args=(stop,))
        other.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        other.join()
        assert not problems, problems[:5]
    assert nn.Module.register_parameter is register_parameter
    assert torch.get_default_dtype() == default_dtype
    assert not nn.Linear(2, 2).weight.is_meta


def test_buffers_match_a_plain_build_and_an_unwritten_buffer_is_an_error(tiny_ckpt, monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    from quantdispatch.errors import CheckpointError

    model = load_model(tiny_ckpt, device="cpu", attn_implementation="eager")
    plain = float_model(make_config("llama", num_hidden_layers=1))
    for name, buf in plain.named_buffers():
        got = model.get_buffer(name)
        assert got.dtype == buf.dtype and torch.equal(got, buf), name
    monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", lambda self, module: None)
    with pytest.raises(CheckpointError, match=r"rotary_emb\.inv_freq.*_init_weights"):
        load_model(tiny_ckpt, device="cpu", attn_implementation="eager")
