"""Wall-clock limits scale with the machine and are settable (dflash_audit/limits.py), and a
limit that is hit says how long it waited and what to raise."""

from __future__ import annotations

import os

import pytest

from dflash_audit.limits import SCALE_ENV, LimitError, exceeded, limit_s, load_factor

ENV = "DFLASH_AUDIT_TEST_LIMIT"


def test_a_limit_is_its_variable_else_the_base_times_the_scale_or_the_load(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(SCALE_ENV, raising=False)
    assert load_factor() >= 1.0
    assert limit_s(100.0, ENV) == pytest.approx(100.0 * load_factor(), rel=0.5)
    monkeypatch.setenv(SCALE_ENV, "2.5")
    assert limit_s(100.0, ENV) == 250.0
    monkeypatch.setenv(ENV, "42")
    assert limit_s(100.0, ENV) == 42.0


@pytest.mark.parametrize("raw", ["0", "-5", "nan", "inf", "abc"])
def test_a_bad_setting_is_refused_with_the_variable_named(monkeypatch, raw):
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(LimitError, match=f"{ENV}={raw!r}"):
        limit_s(100.0, ENV)


def test_the_message_says_how_long_it_waited_the_load_and_the_setting():
    text = exceeded("importing the reference", 180.0, ENV)
    assert text.startswith("importing the reference did not finish in 180 s (load ")
    assert f"on {os.cpu_count()} cores: the machine may be busy" in text
    assert f"{ENV}=540" in text and SCALE_ENV in text


def test_serve_checks_probe_limit_is_settable_and_refuses_nonsense(monkeypatch):
    from dflash_audit.serve.engines import PROBE_TIMEOUT_ENV, ServeCheckError, probe_timeout

    monkeypatch.setenv(PROBE_TIMEOUT_ENV, "7")
    assert probe_timeout() == 7.0
    monkeypatch.setenv(PROBE_TIMEOUT_ENV, "-1")
    with pytest.raises(ServeCheckError, match="give seconds above 0"):
        probe_timeout()
