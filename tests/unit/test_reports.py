"""Fallbacks and degradations are logged once per reason and counted, and warn only on request;
a plan cache smaller than the working set keeps running functionally; every flag checks its value."""

import logging
import os
import warnings

import pytest
import torch

import gpuautograd
from gpuautograd import flags
from tests.helpers import assert_close, rand


def _hooked_backward():
    """A backward that falls back to eager (a hook on a non-leaf, without the native extension,
    which the tests using this turn off), and its leaf."""
    x = rand(4, 3)
    h = x.sin()
    h.register_hook(lambda g: g * 2)
    gpuautograd.backward((h * h).sum())
    return x


def _records(caplog):
    return [r for r in caplog.records if r.name == "gpuautograd"]


def test_by_default_a_fallback_is_logged_once_and_counted_but_not_warned(monkeypatch, caplog):
    monkeypatch.setenv("GPUAUTOGRAD_WARN_FALLBACKS", "0")
    monkeypatch.setenv("GPUAUTOGRAD_NATIVE", "0")
    caplog.set_level(logging.WARNING, logger="gpuautograd")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # code that asserts there are no warnings keeps passing
        for _ in range(3):
            x = _hooked_backward()
            assert_close(x.grad, 2 * 2 * x.detach().sin() * x.detach().cos())
    (record,) = _records(caplog)
    assert record.levelno == logging.WARNING and "falls back to eager" in record.getMessage()
    assert "hook is registered on a non-leaf tensor" in record.getMessage()
    (count,) = gpuautograd.stats()["fallbacks"].values()
    assert count == 3


def test_the_flag_turns_each_reason_into_one_warning(monkeypatch, caplog):
    monkeypatch.setenv("GPUAUTOGRAD_WARN_FALLBACKS", "1")
    monkeypatch.setenv("GPUAUTOGRAD_NATIVE", "0")
    caplog.set_level(logging.WARNING, logger="gpuautograd")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _hooked_backward()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "hook is registered" in messages[0], messages
    assert caught[0].filename == __file__, "the warning points at the caller's line"
    assert len(_records(caplog)) == 1
    gpuautograd.reset()  # reset() forgets which reasons were reported
    with pytest.warns(RuntimeWarning, match="hook is registered"):
        _hooked_backward()


def test_an_error_stays_loud_with_the_flag_off(monkeypatch):
    monkeypatch.setenv("GPUAUTOGRAD_WARN_FALLBACKS", "0")
    x = rand(3)
    with pytest.raises(RuntimeError, match="does not require grad"):
        gpuautograd.backward(x.detach().sum())


def test_a_cache_smaller_than_the_working_set_stays_functional_under_one_message(monkeypatch, caplog):
    """Four graphs cycling through a two-plan cache: every call recaptures, none falls back, and
    one stable message says which flag to raise."""
    monkeypatch.setenv("GPUAUTOGRAD_CACHE_SIZE", "2")
    monkeypatch.setenv("GPUAUTOGRAD_RECAPTURE_LIMIT", "2")
    caplog.set_level(logging.WARNING, logger="gpuautograd")
    fns = (torch.sin, torch.cos, torch.exp, torch.tanh)
    x = rand(5, 3)
    rounds = 5
    for _ in range(rounds):
        for fn in fns:
            x.grad = None
            gpuautograd.backward(fn(x).sum())
            expected = torch.autograd.grad(fn(x).sum(), x)[0]
            assert_close(x.grad, expected)
    s = gpuautograd.stats()
    assert not s["fallbacks"], s["fallbacks"]
    assert s["captures"] == rounds * len(fns) and s["cache_thrash"] == (rounds - 1) * len(fns)
    (record,) = _records(caplog)
    assert "GPUAUTOGRAD_CACHE_SIZE=2" in record.getMessage() and "raise GPUAUTOGRAD_CACHE_SIZE" in record.getMessage()


def test_an_evicted_graph_over_the_recapture_limit_still_runs_eagerly(monkeypatch):
    """Thrash does not reopen a structure's recapture budget: a size over the limit stays eager
    after its fallback entry is evicted, under the same reason."""
    monkeypatch.setenv("GPUAUTOGRAD_CACHE_SIZE", "2")
    monkeypatch.setenv("GPUAUTOGRAD_RECAPTURE_LIMIT", "1")
    for _ in range(3):
        for n in (3, 4, 5):  # 3 is captured; 4 and 5 are over the limit
            x = rand(n)
            gpuautograd.backward(x.exp().sum())
            assert_close(x.grad, x.detach().exp())
    s = gpuautograd.stats()
    (reason,) = s["fallbacks"]
    assert s["fallbacks"][reason] == 6 and "GPUAUTOGRAD_RECAPTURE_LIMIT=1" in reason


BAD_VALUES = [
    ("GPUAUTOGRAD_BACKEND", "gpu", flags.backend, "'auto'"),
    ("GPUAUTOGRAD_DEBUG", "yes", flags.debug_level, "an integer from 0 to 3"),
    ("GPUAUTOGRAD_DEBUG", "4", flags.debug_level, "an integer from 0 to 3"),
    ("GPUAUTOGRAD_CACHE_SIZE", "-1", flags.cache_size, "an integer >= 1"),
    ("GPUAUTOGRAD_CACHE_SIZE", "0", flags.cache_size, "an integer >= 1"),
    ("GPUAUTOGRAD_CACHE_SIZE", "1.5", flags.cache_size, "an integer >= 1"),
    ("GPUAUTOGRAD_RECAPTURE_LIMIT", "0", flags.recapture_limit, "an integer >= 1"),
    ("GPUAUTOGRAD_RECAPTURE_LIMIT", "many", flags.recapture_limit, "an integer >= 1"),
    ("GPUAUTOGRAD_MAX_SEGMENTS", "-2", flags.max_segments, "an integer >= 0"),
    ("GPUAUTOGRAD_WARN_FALLBACKS", "yes", flags.warn_fallbacks, "'0', '1'"),
    ("GPUAUTOGRAD_EXTERN_BINDING", "mirror", flags.extern_binding, "'copy', 'table'"),
]


@pytest.mark.parametrize("name,value,read,accepts", BAD_VALUES, ids=[f"{n}={v}" for n, v, _, _ in BAD_VALUES])
def test_a_bad_flag_value_names_the_flag_and_what_it_accepts(monkeypatch, name, value, read, accepts):
    monkeypatch.setenv(name, value)
    with pytest.raises(flags.FlagError) as info:
        read()
    message = str(info.value)
    assert f"{name}={value!r}" in message and accepts in message, message


def test_a_flag_follows_every_way_the_environment_changes(monkeypatch):
    """Flags are read on every use: a set, a delete, os.environ replaced whole (as mock.patch does),
    and a non-ASCII value all read as os.environ.get would."""
    monkeypatch.setenv("GPUAUTOGRAD_BACKEND", "reference")
    assert flags.backend() == "reference"
    monkeypatch.delenv("GPUAUTOGRAD_BACKEND")
    assert flags.backend() == "auto"
    monkeypatch.setattr(os, "environ", {"GPUAUTOGRAD_BACKEND": "interpret"})
    assert flags.backend() == "interpret"
    monkeypatch.undo()
    monkeypatch.setenv("GPUAUTOGRAD_DUMP_DIR", "/nonexistent/caf\u00e9")
    assert flags._env("GPUAUTOGRAD_DUMP_DIR", "") == os.environ.get("GPUAUTOGRAD_DUMP_DIR")


def test_a_bad_flag_fails_the_backward_that_reads_it(monkeypatch):
    """The value is checked where it is used: a backward that captures reads the cache size."""
    monkeypatch.setenv("GPUAUTOGRAD_CACHE_SIZE", "-1")
    x = rand(3)
    with pytest.raises(flags.FlagError, match="GPUAUTOGRAD_CACHE_SIZE='-1'"):
        gpuautograd.backward(x.sin().sum())


def test_a_dump_dir_that_is_a_file_is_refused(monkeypatch, tmp_path):
    path = tmp_path / "kernels"
    path.write_text("")
    monkeypatch.setenv("GPUAUTOGRAD_DUMP_DIR", str(path))
    with pytest.raises(flags.FlagError, match="GPUAUTOGRAD_DUMP_DIR=.*accepts a directory"):
        flags.dump_dir()


@pytest.mark.parametrize(
    "name,value,read,expected",
    [
        ("GPUAUTOGRAD_DEBUG", " 2 ", flags.debug_level, 2),
        ("GPUAUTOGRAD_CACHE_SIZE", "1", flags.cache_size, 1),
        ("GPUAUTOGRAD_MAX_SEGMENTS", "0", flags.max_segments, 0),
        ("GPUAUTOGRAD_WARN_FALLBACKS", "1", flags.warn_fallbacks, True),
        ("GPUAUTOGRAD_BACKEND", "interpret-replay", flags.backend, "interpret-replay"),
    ],
)
def test_good_flag_values_are_read(monkeypatch, name, value, read, expected):
    monkeypatch.setenv(name, value)
    assert read() == expected
