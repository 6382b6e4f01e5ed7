"""evaluate.sampling: the sampling settings every evaluate table is computed at (pipeline.config)."""
from __future__ import annotations

import pytest

from pipeline.config import ConfigError, evaluate_settings
from pipeline.run import DEFAULT_CONFIG, load_config
from training.spec_sampling import Sampling


def _cfg(*overrides: str):
    return load_config(DEFAULT_CONFIG, ["+stage=evaluate", *overrides])


def _settings(*overrides: str) -> list:
    return evaluate_settings(_cfg(*overrides))


def test_default_is_greedy_plain_and_the_generate_setting():
    got = _settings()
    assert got == [Sampling(0.0), Sampling(1.0), Sampling(0.7, 0.8, 20)]
    assert [(s.temperature, s.top_p, s.top_k) for s in got][2] == (0.7, 0.8, 20)
    assert _settings("generate.temperature=1.0", "generate.top_p=1.0", "generate.top_k=-1") == [Sampling(0.0), Sampling(1.0)]


def test_sampling_list_and_the_deprecated_temperatures():
    got = _settings("evaluate.sampling=[{temperature:0.6,top_p:0.95,top_k:20},{temperature:0}]")
    assert got == [Sampling(0.6, 0.95, 20), Sampling(0.0)] and f"T={got[0]:g}" == "T=0.6,p0.95,k20"
    assert _settings("evaluate.temperatures=[0.0,0.7]") == [Sampling(0.0), Sampling(0.7)]   # old configs still run


def test_bad_settings_name_the_key_and_the_fix():
    with pytest.raises(ConfigError, match="evaluate.temperatures: is the deprecated form of evaluate.sampling"):
        _cfg("evaluate.temperatures=[0.0]", "evaluate.sampling=[{temperature:1.0}]")
    with pytest.raises(ConfigError, match=r"evaluate.sampling: top_p must be in \(0, 1\]"):
        _cfg("evaluate.sampling=[{temperature:1.0,top_p:0.0}]")
    with pytest.raises(ConfigError, match="evaluate.sampling: must list at least one setting"):
        _cfg("evaluate.sampling=[]")
