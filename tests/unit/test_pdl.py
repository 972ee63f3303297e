"""Programmatic dependent launch switches (kernels/common/pdl.py): when kernels may use it and the
QUANTDISPATCH_PDL setting that turns it off (read by the kernels and by Settings alike)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from quantdispatch.api import current_settings, load_settings
from quantdispatch.errors import ConfigurationError
from quantdispatch.kernels.common import pdl


@pytest.mark.parametrize(
    "value, on",
    [(None, True), ("1", True), (" true ", True), ("", True), ("0", False), ("off", False)],
)
def test_env_turns_it_on_and_off(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    else:
        monkeypatch.setenv(pdl.PDL_ENV, value)
    assert pdl.pdl_enabled() is on
    assert current_settings().pdl is on  # a known variable: select() and doctor accept it
    assert current_settings().describe()["pdl"] is on


@pytest.mark.parametrize("value", ["yes please", "2", "enabled"])
def test_malformed_value_names_itself_and_the_fix(monkeypatch, value):
    monkeypatch.setenv(pdl.PDL_ENV, value)
    with pytest.raises(ConfigurationError, match=rf"QUANTDISPATCH_PDL='{value}'.*PDL=0 or 1"):
        pdl.pdl_enabled()
    with pytest.raises(ConfigurationError, match=rf"QUANTDISPATCH_PDL='{value}' is not a boolean"):
        load_settings({pdl.PDL_ENV: value})


def test_never_off_a_cuda_gpu():
    assert not pdl.pdl_capable(torch.device("cpu"))
