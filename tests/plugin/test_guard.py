"""plugin/guard.py: one guard for every SGLang patch. A hook's own error turns its patch off (said once) and hands
the step to SGLang's path; SGLang's own errors pass through untouched and SGLang's call never runs twice; a patch
that must not be skipped falls the engine back instead; a patch whose hooks did not all take effect is off."""

from __future__ import annotations

import logging

import pytest

from specctl.plugin.guard import AFTER, AROUND, BEFORE, Guard, Patch


class Sglang:
    """SGLang's own function: counts its calls, raises when told to."""

    def __init__(self, fail=False):
        self.calls, self.fail = 0, fail

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.fail:
            raise KeyError("sglang's own error")
        return ("sglang", args, kwargs)


def test_an_error_before_sglangs_call_turns_the_patch_off_and_runs_sglangs_path_once(caplog):
    p = Patch("demo")

    def hook(orig, x):
        raise RuntimeError("ours")

    orig = Sglang()
    wrapped = p.wrapped(AROUND, hook)
    with caplog.at_level(logging.ERROR, logger="specctl.plugin"):
        assert wrapped(orig, 1) == ("sglang", (1,), {})
        assert wrapped(orig, 2) == ("sglang", (2,), {})  # off: straight through, the hook is not called
    assert orig.calls == 2 and not p.on and p.status() == "off: RuntimeError: ours"
    assert [r.getMessage() for r in caplog.records] == ["specctl: patch demo off: RuntimeError: ours"]


def test_an_error_after_sglangs_call_keeps_its_result_and_never_calls_it_again():
    p = Patch("demo")

    def hook(orig, x):
        out = orig(x)
        raise ValueError("bookkeeping after the call")

    orig = Sglang()
    assert p.wrapped(AROUND, hook)(orig, 7) == ("sglang", (7,), {}) and orig.calls == 1 and not p.on


def test_sglangs_own_error_passes_through_and_leaves_the_patch_on():
    p = Patch("demo")
    orig = Sglang(fail=True)
    with pytest.raises(KeyError, match="sglang's own error"):
        p.wrapped(AROUND, lambda o, x: o(x))(orig, 1)
    assert orig.calls == 1 and p.on


@pytest.mark.parametrize("kind", [BEFORE, AFTER])
def test_before_and_after_hooks_fail_into_sglangs_path(kind):
    p = Patch("demo")

    def hook(*a, **k):
        raise RuntimeError("ours")

    wrapped = p.wrapped(kind, hook)
    assert (wrapped(1) if kind == BEFORE else wrapped("ret", 1)) is None  # SGLang's arguments / return value stand
    assert not p.on


def test_a_patch_that_must_not_be_skipped_falls_the_engine_back_and_raises():
    failed = []
    p = Patch("widths", must_run=True, on_must_run_error=failed.append)

    def hook(worker):
        raise AttributeError("no topk")

    with pytest.raises(AttributeError):
        p.wrapped(BEFORE, hook)(object())
    assert failed == ["patch widths raised AttributeError: no topk"] and p.on  # its hooks keep running


def test_build_publishes_only_what_every_rank_built():
    votes = []
    p = Patch("demo", collective=True)
    assert p.build(lambda: "a launch it cannot serve", agree=lambda ok: votes.append(ok) or ok) is None
    assert votes == [False] and p.obj is None and p.off_reason == "a launch it cannot serve"
    q = Patch("demo")
    assert q.build(lambda: object(), agree=lambda ok: False) is None and q.obj is None
    assert q.off_reason == "another TP rank could not build it"
    r = Patch("demo")

    def boom():
        raise MemoryError("capture out of memory")

    assert r.build(boom) is None and "MemoryError: capture out of memory" in r.off_reason
    s = Patch("demo")
    obj = object()
    assert s.build(lambda: obj, agree=lambda ok: ok) is obj and s.live() is obj


def test_the_start_up_check_turns_off_each_patch_missing_a_hook():
    a = Patch("a").hook(AROUND, "x.A.f", lambda o: o())
    b = Patch("b").hook(AROUND, "x.B.f", lambda o: o()).hook(AFTER, "x.B.g", lambda r: None)
    c = Patch("c").hook(AROUND, "x.C.f", lambda o: o())
    g = Guard([a, b, c])
    assert g.check({"x.A.f", "x.B.f", "x.C.f"}, skip=("c",)) == {"b": ["x.B.g"]}
    assert g.status() == {"a": "on", "b": "off: the hooks on x.B.g did not take effect", "c": "on"}
    assert [t for t, _, _ in g.registrations()] == ["x.A.f", "x.C.f"]  # an off patch registers nothing
    assert Guard([Patch("d").hook(AROUND, "x.D.f", lambda o: o())]).check(None) == {"d": ["x.D.f"]}
    with pytest.raises(ValueError, match="added twice"):
        Guard([Patch("a"), Patch("a")])


def test_clean_up_runs_once_when_the_patch_goes_off():
    p = Patch("demo", mode="check")
    dropped = []
    p.when_off(lambda: dropped.append(1))
    assert p.status() == "check"
    p.turn_off("first")
    p.turn_off("second")
    assert dropped == [1] and p.status() == "off: first"


def test_there_is_one_turn_off_in_the_plugin():
    """No patch keeps its own on/off switch: every `def turn_off` of the plugin is the guard's."""
    from pathlib import Path

    root = Path(__file__).parents[2] / "plugin"
    owners = [str(f.relative_to(root)) for f in root.rglob("*.py") if "def turn_off" in f.read_text()]
    assert owners == ["guard.py"]
