"""Programmatic dependent launch switches (kernels/gdc.py): when kernels may use it and the env
variable that turns it off."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from quantdispatch.errors import ConfigurationError
from quantdispatch.kernels import gdc


@pytest.fixture
def fresh_env(monkeypatch):
    gdc.pdl_enabled.cache_clear()
    yield monkeypatch
    gdc.pdl_enabled.cache_clear()


def test_env_turns_it_on_and_off(fresh_env):
    fresh_env.delenv(gdc.PDL_ENV, raising=False)
    assert gdc.pdl_enabled()
    gdc.pdl_enabled.cache_clear()
    fresh_env.setenv(gdc.PDL_ENV, "0")
    assert not gdc.pdl_enabled()
    gdc.pdl_enabled.cache_clear()
    fresh_env.setenv(gdc.PDL_ENV, " 1 ")
    assert gdc.pdl_enabled()


@pytest.mark.parametrize("value", ["yes", "2", "", "true"])
def test_malformed_env_value_names_itself_and_the_fix(fresh_env, value):
    fresh_env.setenv(gdc.PDL_ENV, value)
    with pytest.raises(ConfigurationError, match=rf"QUANTDISPATCH_PDL='{value.strip()}'.*0 or 1"):
        gdc.pdl_enabled()


def test_never_off_a_cuda_gpu():
    assert not gdc.pdl_capable(torch.device("cpu"))
