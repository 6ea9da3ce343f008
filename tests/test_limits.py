"""Wall-clock limits scale with the machine and are settable (dflash_audit/limits.py), and a
limit that is hit says how long it waited and what to raise."""

from __future__ import annotations

import os
import time

import pytest

from dflash_audit.limits import SCALE_ENV, LimitError, Watch, exceeded, limit_s, load_factor

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


def test_a_watch_stretches_with_the_load_but_a_fixed_limit_does_not(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv(SCALE_ENV, "1")
    stretched, fixed = Watch(0.05, ENV), Watch(0.05, ENV, fixed_s=0.05)
    assert stretched.limit == fixed.limit == 0.05
    time.sleep(0.1)
    monkeypatch.setenv(SCALE_ENV, "100")  # the machine got busier while it waited
    assert not stretched.over() and stretched.limit == 5.0
    assert fixed.over() and fixed.limit == 0.05
    monkeypatch.setenv(SCALE_ENV, "1")  # and quieter again: never shorter than it was
    assert not stretched.over() and stretched.limit == 5.0
    stretched.restart()
    assert stretched.limit == 0.05 and stretched.elapsed() < 0.05


def test_a_limit_with_an_option_names_it_first_and_alone_when_it_was_given():
    scaled = exceeded("the candidate's run_case", 600.0, ENV, option="--candidate-timeout")
    assert scaled.endswith(f"raise the limit with --candidate-timeout 1800 (or {ENV}=1800 or "
                           f"{SCALE_ENV}=3 for every limit)")
    given = exceeded("the candidate's run_case", 5.0, ENV, option="--candidate-timeout",
                     scaled=False)
    assert given.endswith(
        ": the machine may be busy); raise the limit with --candidate-timeout 15")


@pytest.mark.parametrize("env", ["DFLASH_AUDIT_CANDIDATE_TIMEOUT",
                                 "DFLASH_AUDIT_CANDIDATE_START_TIMEOUT",
                                 "DFLASH_AUDIT_REFERENCE_TIMEOUT"])
def test_compare_refuses_a_bad_limit_before_any_work(monkeypatch, tmp_path, env):
    from dflash_audit.audit.options import CompareOptions, check_options
    from dflash_audit.audit.setup_error import CompareSetupError

    monkeypatch.setenv(env, "soon")
    with pytest.raises(CompareSetupError, match=f"{env}='soon': give seconds above 0"):
        check_options(CompareOptions(out=tmp_path))
    monkeypatch.setenv(env, "30")
    check_options(CompareOptions(out=tmp_path))
