"""SPECCTL_HOST_SEQ_LENS (plugin/host_seq_lens.py): after a decode-state step the next step's sequence lengths come
from the host instead of SGLang 0.5.17's device pull. The settings; then SGLang's own FutureMap (on the CPU, where
its pull is `.cpu()`), its publish and resolve wrapped as SGLang's hook registry wraps them, against the same
sequence run without the hooks; then install() through the registry in a fresh interpreter."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from specctl.plugin.engine import PluginSettings

HERE = Path(__file__).parent


@pytest.mark.parametrize("value, mode, steps", [
    (None, "check", 32),  # the default since its GPU run (2026-12-06): compare first, then trust
    ("off", "off", 32), ("on", "on", 32), ("check", "check", 32), ("check:5", "check", 5),
])
def test_settings_read_the_switch(value, mode, steps):
    env = {} if value is None else {"SPECCTL_PATCHES": f"host_lens={value}"}
    s = PluginSettings.from_env(env)
    assert (s.host_seq_lens, s.host_seq_lens_check_steps) == (mode, steps)
    assert s.host_seq_lens_set is (value is not None)  # where it cannot apply: a warning only if it was asked for


@pytest.mark.parametrize("value", ["auto", "check:", "check:0", "on:3"])
def test_settings_refuse_nonsense(value):
    with pytest.raises(ValueError, match="SPECCTL_PATCHES: host_lens"):
        PluginSettings.from_env({"SPECCTL_PATCHES": f"host_lens={value}"})


# ----------------------------------------------------------------------------- SGLang's FutureMap

def _version() -> str:
    import sglang

    return sglang.__version__


@pytest.fixture
def fm_class():
    """SGLang 0.5.17's FutureMap (0.5.23's resolve takes another argument: the setting does nothing there)."""
    if _version() != "0.5.17":
        pytest.skip("the host_lens patch is written against SGLang 0.5.17's FutureMap")
    from sglang.srt.managers.overlap_utils import FutureMap

    return FutureMap


def _hooked(fm_class, hl, debug=lambda: False):
    """A subclass whose publish / resolve carry our AROUND hooks, wrapped by SGLang's own hook wrapper."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    from specctl.plugin.patches.host_lens import around_publish, around_resolve

    def pub(o, fm, idx, *a, **k):
        return around_publish(hl, o, fm, idx, *a, **k)

    def res(o, fm, batch, *a, **k):
        return around_resolve(hl, debug, o, fm, batch, *a, **k)

    return type("HookedFutureMap", (fm_class,), {
        "publish": _wrap_fn(fm_class.publish, pub, HookType.AROUND),
        "resolve_seq_lens_cpu": _wrap_fn(fm_class.resolve_seq_lens_cpu, res, HookType.AROUND)})


def _fmap(cls, needs_cpu=True):
    import torch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    pool = SimpleNamespace(req_to_token=torch.zeros(32, 8, dtype=torch.int32))
    return cls(torch.device("cpu"), SpeculativeAlgorithm.EAGLE3, pool, needs_cpu_seq_lens=needs_cpu)


def _batch(rows):
    import torch

    return SimpleNamespace(spec_info=SimpleNamespace(future_indices=torch.tensor(rows)),
                           req_pool_indices_cpu=torch.tensor(rows), seq_lens=None, seq_lens_cpu=None,
                           seq_lens_sum=None)


class Loop:
    """The overlap scheduler's order, per batch: resolve (the lengths after the last step), the forward (our
    forward hook hands over its rows, a prefill its lengths), the decode state's verify (the lengths it planned
    with), the publish."""

    def __init__(self, fm, hl=None):
        self.fm, self.hl, self.seen = fm, hl, []

    def prefill(self, rows, lens):
        import torch

        self.fm.resolve_seq_lens_cpu(SimpleNamespace(spec_info=None))  # an EXTEND batch: SGLang's returns at once
        if self.hl is not None:
            self.hl.begin_forward(torch.tensor(rows), torch.tensor(lens))
        self.fm.publish(torch.tensor(rows), torch.tensor(lens))

    def step(self, rows, accept=None, decode_state=True, hand_over_shift=0):
        """One decode step of these rows: resolve, then publish committed + accepted (1 in the decode state)."""
        import torch

        b = _batch(rows)
        self.fm.resolve_seq_lens_cpu(b)
        self.seen.append((b.seq_lens.tolist(), None if b.seq_lens_cpu is None else b.seq_lens_cpu.tolist(),
                          b.seq_lens_sum))
        acc = torch.tensor(accept) if accept is not None else torch.ones(len(rows), dtype=torch.int64)
        if self.hl is not None:
            self.hl.begin_forward(b.req_pool_indices_cpu)
            if decode_state:  # what the decode forward planned with (None on triton)
                planned = None if b.seq_lens_cpu is None else b.seq_lens_cpu + hand_over_shift
                self.hl.on_decode_step(b.req_pool_indices_cpu, planned)
        self.fm.publish(b.req_pool_indices_cpu, b.seq_lens + acc)
        return b


def _script(loop):
    """Prefills, decode-state steps, a finished request, a newcomer, a speculative step, a shrinking batch."""
    loop.prefill([1, 2, 3], [10, 20, 30])
    for _ in range(3):
        loop.step([1, 2, 3])
    loop.step([1, 3])                           # request 2 finished: a subset of the last publish's rows
    loop.prefill([5], [7])                      # a newcomer's prefill publishes
    loop.step([1, 3, 5])
    loop.step([1, 3, 5])
    loop.step([1, 3, 5], accept=[3, 1, 2], decode_state=False)  # a speculative step: lengths only on the device
    loop.step([1, 3, 5])
    loop.step([3, 5])
    loop.step([3, 5])


@pytest.mark.sglang
def test_the_host_lengths_are_the_devices_and_spare_the_pull_after_decode_state_steps(fm_class):
    from specctl.plugin.patches.host_lens import HostSeqLens

    stock = Loop(_fmap(fm_class))
    _script(stock)
    hl = HostSeqLens("on")
    mine = Loop(_fmap(_hooked(fm_class, hl)), hl)
    _script(mine)
    assert mine.seen == stock.seen  # the device gather, the host lengths and their sum, step by step
    # the device only after the speculative step: every other step follows a prefill or a decode-state step
    assert (hl.num_host, hl.num_device) == (9, 1)
    assert hl.on and hl.off_reason is None


@pytest.mark.sglang
def test_a_row_the_copy_does_not_hold_and_a_hand_over_no_publish_took_go_to_the_device(fm_class):
    import torch

    from specctl.plugin.patches.host_lens import HostSeqLens

    hl = HostSeqLens("on")
    loop = Loop(_fmap(_hooked(fm_class, hl)), hl)
    loop.fm.publish(torch.tensor([1, 2, 4]), torch.tensor([10, 20, 40]))  # a publish with no hand-over: seeding
    assert hl.lens == {}
    loop.prefill([1, 2], [10, 20])
    loop.step([1, 2])
    loop.step([1, 2, 4])                        # row 4: published, but not as the host could follow
    assert (hl.num_host, hl.num_device) == (1, 1)
    hl.begin_forward(torch.tensor([1, 2, 4]))
    hl.on_decode_step(torch.tensor([1, 2, 4]), torch.tensor([99, 99, 99]))  # handed over, never published
    loop.fm.resolve_seq_lens_cpu(b := _batch([1, 2, 4]))
    assert b.seq_lens_cpu.tolist() == [12, 22, 41] and hl.expect is None and hl.values is None


@pytest.mark.sglang
def test_publishes_update_the_copy_row_by_row_as_they_were_handed_over(fm_class):
    import torch

    from specctl.plugin.patches.host_lens import HostSeqLens

    hl = HostSeqLens("on")
    fm = _fmap(_hooked(fm_class, hl))
    hl.begin_forward(torch.tensor([1, 2]), torch.tensor([5, 6]))  # a prefill
    fm.publish(torch.tensor([1, 2]), torch.tensor([5, 6]))
    hl.begin_forward(torch.tensor([3]), torch.tensor([9]))        # another
    fm.publish(torch.tensor([3]), torch.tensor([9]))
    assert hl.lens == {1: (5, True), 2: (6, True), 3: (9, True)}
    hl.begin_forward(torch.tensor([1, 2]))                         # a decode-state step of rows 1 and 2
    hl.on_decode_step(torch.tensor([1, 2]), torch.tensor([5, 6]))
    fm.publish(torch.tensor([1, 2]), torch.tensor([6, 7]))
    assert hl.lens == {1: (6, False), 2: (7, False), 3: (9, True)}
    hl.begin_forward(torch.tensor([2, 3]))                         # a speculative step: its rows leave the copy
    fm.publish(torch.tensor([2, 3]), torch.tensor([9, 11]))
    assert hl.lens == {1: (6, False)}
    hl.begin_forward(torch.tensor([1]))
    hl.on_decode_step(torch.tensor([2]), torch.tensor([6]))        # not the forward's rows: no lengths
    fm.publish(torch.tensor([1]), torch.tensor([7]))
    assert hl.lens == {}
    hl.begin_forward(torch.tensor([1, 2]), torch.tensor([5, 6]))
    fm.publish(torch.tensor([1, 2, 3]), torch.tensor([5, 6, 1]))   # another size than the hand-over
    assert hl.lens == {}
    fm.publish(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))  # DP idle: no write
    assert hl.lens == {}


@pytest.mark.sglang
def test_check_mode_compares_then_trusts_and_a_difference_turns_it_off(fm_class, caplog):
    from specctl.plugin.patches.host_lens import HostSeqLens

    hl = HostSeqLens("check", check_steps=2)
    loop = Loop(_fmap(_hooked(fm_class, hl)), hl)
    with caplog.at_level(logging.INFO, logger="specctl"):
        _script(loop)
    # compared: the first two eligible steps (the first after a prefill among them) and the newcomer's first step
    # (the second with a prefill's rows); then trusted
    assert hl.num_checked == 3 and hl.check_left == hl.check_prefill_left == 0 and hl.num_host == 6 and hl.on
    assert any("self-check passed: 3 steps" in r.getMessage() for r in caplog.records)

    stock = Loop(_fmap(fm_class))
    _script(stock)
    bad = HostSeqLens("check", check_steps=2)
    wrong = Loop(_fmap(_hooked(fm_class, bad)), bad)
    wrong.prefill([1, 2, 3], [10, 20, 30])
    wrong.step([1, 2, 3], hand_over_shift=1)    # a hand-over one token off
    with caplog.at_level(logging.WARNING, logger="specctl"):
        wrong.step([1, 2, 3])
    assert not bad.on and "differ" in bad.off_reason and bad.num_host == 0
    assert wrong.seen == stock.seen[:2]         # the step that caught it ran on the device's lengths
    wrong.step([1, 2, 3])
    assert bad.num_host == 0 and any("patch host_lens off" in r.getMessage() for r in caplog.records)


@pytest.mark.sglang
def test_after_the_check_one_step_in_audit_every_still_compares(fm_class, monkeypatch):
    from specctl.plugin.patches import host_lens as host_seq_lens
    from specctl.plugin.patches.host_lens import HostSeqLens

    monkeypatch.setattr(host_seq_lens, "AUDIT_EVERY", 3)
    hl = HostSeqLens("on")
    loop = Loop(_fmap(_hooked(fm_class, hl)), hl)
    loop.prefill([1, 2], [10, 20])
    loop.step([1, 2])
    loop.step([1, 2])
    assert (hl.num_host, hl.num_checked) == (2, 0)
    loop.step([1, 2])                           # the third: audited, and right
    assert (hl.num_host, hl.num_checked) == (2, 1) and hl.on
    loop.step([1, 2])
    hl._len[2] = 999                            # a copy gone wrong after the check
    loop.step([1, 2])                           # used: what the audit exists to bound
    loop.step([1, 2])                           # audited: caught
    assert not hl.on and "differ" in hl.off_reason and hl.num_checked == 2


@pytest.mark.sglang
@pytest.mark.parametrize("case", ["triton", "debug-assert", "off"])
def test_where_sglang_needs_no_host_lengths_or_its_debug_mode_is_on_nothing_changes(fm_class, case):
    from specctl.plugin.patches.host_lens import HostSeqLens

    hl = HostSeqLens("off" if case == "off" else "on")
    cls = _hooked(fm_class, hl, debug=(lambda: True) if case == "debug-assert" else (lambda: False))
    needs_cpu = case != "triton"
    stock, mine = Loop(_fmap(fm_class, needs_cpu)), Loop(_fmap(cls, needs_cpu), hl)
    _script(stock)
    _script(mine)
    assert mine.seen == stock.seen and hl.num_host == 0
    if case == "triton":  # nothing to skip: the first publish stands the copy down, without a warning
        assert not hl.on and hl.off_reason is None and "needs_cpu_seq_lens is False" in hl.not_needed
        assert hl.lens == {} and hl.status()["not_needed"] == hl.not_needed


@pytest.mark.sglang
def test_a_fault_in_the_hook_runs_sglangs_resolve_and_turns_it_off(fm_class, caplog):
    from specctl.plugin.patches.host_lens import HostSeqLens

    hl = HostSeqLens("on")
    loop = Loop(_fmap(_hooked(fm_class, hl)), hl)
    loop.prefill([1, 2], [10, 20])
    loop.step([1, 2])
    hl._len = None                              # a copy that cannot be read
    with caplog.at_level(logging.WARNING, logger="specctl"):
        loop.step([1, 2])
    assert loop.seen[-1] == ([11, 21], [11, 21], 32) and not hl.on and "TypeError" in hl.off_reason


@pytest.mark.sglang
def test_supported_only_where_resolve_takes_the_batch_alone():
    from sglang.srt.managers.overlap_utils import FutureMap

    from specctl.plugin.patches.host_lens import supported

    why = supported(FutureMap.resolve_seq_lens_cpu)
    if _version() == "0.5.17":
        assert why is None
    else:
        assert "stream_ordered" in why and "nothing done" in why
    assert "takes ['batch', 'extra']" in supported(lambda self, batch, extra: None)


# ----------------------------------------------------------------------------- the decode state's hand-over

@pytest.mark.sglang
def test_the_verify_hook_hands_over_only_after_a_decode_forward_ran(monkeypatch):
    import torch

    from specctl.plugin import runtime as plugin_runtime
    from specctl.plugin.patches import plain_decode
    from specctl.plugin.patches.host_lens import HostSeqLens

    plain = SimpleNamespace(on=True, ran=True, planned=("stale", "stale"))
    rt = SimpleNamespace(plain=plain, host_lens=HostSeqLens("on"))
    monkeypatch.setattr(plugin_runtime, "_RUNTIME", rt)
    worker = SimpleNamespace(speculative_num_steps=0)
    rows, lens = torch.tensor([4, 9]), torch.tensor([100, 7])

    def ran(plain_, orig, w, b, a, k):
        plain_.ran, plain_.planned = True, (rows, lens)
        return "out"

    def trivial(plain_, orig, w, b, a, k):  # a step the decode state leaves to SGLang (log-probabilities, say)
        return "out"

    monkeypatch.setattr(plain_decode, "around_verify", ran)
    rt.host_lens.begin_forward(rows)
    assert plain_decode.around_verify_hook(None, worker, "batch") == "out"
    assert rt.host_lens.values.tolist() == [101, 8]
    rt.host_lens.begin_forward(rows)
    monkeypatch.setattr(plain_decode, "around_verify", trivial)
    plain_decode.around_verify_hook(None, worker, "batch")
    assert rt.host_lens.values is None  # the last step's planned lengths are not this one's


@pytest.mark.sglang
def test_the_forward_hook_hands_over_a_prefills_lengths_and_a_decode_steps_rows(monkeypatch):
    import torch
    from specctl.plugin import runtime as plugin_runtime
    from specctl.plugin.patches import host_lens
    from specctl.plugin.patches.host_lens import HostSeqLens

    rt = SimpleNamespace(host_lens=HostSeqLens("on"), timer=None, _wants_ctx=lambda: False)
    monkeypatch.setattr(plugin_runtime, "_RUNTIME", rt)
    before = rt.host_lens.patch.wrapped("BEFORE", host_lens.before_forward)  # guarded, as install() registers it

    def forward(orig, worker, b):  # SGLang's wrapper: the BEFORE hook, then the forward
        before(worker, b)
        return orig(worker, b)

    batch = lambda mode: SimpleNamespace(forward_mode=mode, req_pool_indices_cpu=torch.tensor([3, 1]),  # noqa: E731
                                         seq_lens_cpu=torch.tensor([70, 12]))
    seen = []
    tl = lambda a: None if a is None else a.tolist()  # noqa: E731
    orig = lambda worker, b, **k: seen.append((tl(rt.host_lens.expect), tl(rt.host_lens.values))) or "out"  # noqa: E731
    mode = lambda name: SimpleNamespace(name=name)  # noqa: E731 - ForwardMode's members by name (the hook reads that)
    assert forward(orig, None, batch(mode("EXTEND"))) == "out"
    forward(orig, None, batch(mode("DECODE")))
    forward(orig, None, batch(mode("MIXED")))  # decode rows inside: no lengths
    assert seen == [([3, 1], [70, 12]), ([3, 1], None), ([3, 1], None)]
    forward(orig, None, SimpleNamespace(forward_mode=mode("DECODE")))  # no rows: unreadable
    assert not rt.host_lens.on and "AttributeError" in rt.host_lens.off_reason


# ----------------------------------------------------------------------------- install(), SGLang's registry

def _run(code: str) -> dict:
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"), cwd=str(HERE))
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


INSTALL = r"""
    import json, logging, sys
    import torch
    from types import SimpleNamespace
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from sglang.srt.plugins.hook_registry import HookRegistry
    from specctl.plugin import sglang_hooks
    from specctl.plugin.engine import PluginSettings
    env = {"SPECCTL_TELEMETRY": "none", "SPECCTL_POLICY": "none"}
    patches = ([f"host_lens={MODE}"] if MODE is not None else []) + EXTRA
    if patches:
        env["SPECCTL_PATCHES"] = ",".join(patches)
    rt = sglang_hooks.install(PluginSettings.from_env(env))
    HookRegistry.apply_hooks()
    t = sglang_hooks.SGLANG_TARGETS
    out = {"patched": [x in HookRegistry._patched for x in t.host_lens_targets()], "hooked": rt.host_lens is not None}
    if rt.host_lens is not None:
        from sglang.srt.managers.overlap_utils import FutureMap
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        fm = FutureMap(torch.device("cpu"), SpeculativeAlgorithm.EAGLE3,
                       SimpleNamespace(req_to_token=torch.zeros(8, 4, dtype=torch.int32)))
        fm.publish(torch.tensor([1, 2]), torch.tensor([10, 20]))
        rt.host_lens.begin_forward(torch.tensor([1, 2]))  # what the forward hook does (its module: a GPU build)
        rt.host_lens.on_decode_step(torch.tensor([1, 2]), torch.tensor([10, 20]))
        fm.publish(torch.tensor([1, 2]), torch.tensor([11, 21]))
        b = SimpleNamespace(spec_info=SimpleNamespace(future_indices=torch.tensor([2, 1])),
                            req_pool_indices_cpu=torch.tensor([2, 1]), seq_lens=None, seq_lens_cpu=None)
        fm.resolve_seq_lens_cpu(b)
        out.update(lens=b.seq_lens_cpu.tolist(), device=b.seq_lens.tolist(), status=rt.host_lens.status())
        out["problems"] = rt.check_hooks()
        out["after_check"] = rt.host_lens.status()
    print(json.dumps(out))
"""


@pytest.mark.sglang
@pytest.mark.parametrize("mode, extra", [("on", []), (None, []), ("off", []), ("on", ["plain_decode=off"]),
                                         (None, ["plain_decode=off"])])
def test_install_hooks_sglangs_futuremap_where_it_applies(mode, extra):
    got = _run(INSTALL.replace("MODE", repr(mode)).replace("EXTRA", repr(extra)))
    if mode == "off" or extra or _version() != "0.5.17":
        assert got == {"patched": [False, False], "hooked": False}
        return
    assert got["patched"] == [True, True] and got["hooked"]
    # SGLang's own FutureMap, patched by its registry: the resolve after a decode-state publish takes the host's
    # (the default, check, pulls as well and compares)
    assert got["lens"] == got["device"] == [21, 11]
    assert got["status"]["on"] and got["status"]["mode"] == (mode or "check")
    assert (got["status"]["host_resolves"], got["status"]["checked"]) == ((1, 0) if mode == "on" else (0, 1))
    assert not [p for p in got["problems"] if "FutureMap" in p]
    worker_hooked = not any("EAGLEWorkerV2.forward_batch_generation" in p for p in got["problems"])
    # the start-up check: without the forward hook (this CPU install cannot patch the worker's module) the copy
    # would never be fed: it is turned off, said once
    assert got["after_check"]["on"] == worker_hooked
    if not worker_hooked:
        assert "did not take effect" in got["after_check"]["off_reason"]
