"""What `specctl demo` shows: its progress line, its verdict lines and the page it draws."""

import io
from dataclasses import replace

import pytest

from specctl.controller import wire
from specctl.harness import simbench
from specctl.harness.cli_bench import _Progress
from specctl.training.simulator import load_profile, parse_workload

PHASES = [("warm", 4, 2), ("surge", 6, 32), ("cool", 2, 4)]  # name, seconds, concurrency
WORKLOAD = {"schema": "specctl.workload/1", "seed": 3,
            "classes": {"code": {"accept": {"s1": [0.85], "s3": [0.85, 0.8, 0.75]}, "output_tokens": [64, 128]},
                        "chat": {"accept": {"s1": [0.6], "s3": [0.6, 0.5, 0.4]}, "output_tokens": [32, 64]}},
            "phases": [{"name": n, "duration_s": d, "concurrency": c, "mix": {"code": 0.5, "chat": 0.5}}
                       for n, d, c in PHASES]}
POLICY = wire.policy_from_obj({
    "kind": "policy", "schema": 1, "version": 7, "created_at": 1.0, "source": "online",
    "table": [{"min_batch": 1, "max_batch": 3, "config": {"steps": 3, "topk": 1, "draft_tokens": 4}},
              {"min_batch": 4, "max_batch": 4, "config": {"steps": 1, "topk": 1, "draft_tokens": 2}},
              {"min_batch": 5, "max_batch": None, "config": {"steps": 0, "topk": 1, "draft_tokens": 1}}]})
STEP_S = 0.05
TOKENS_PER_STEP = 10  # 200 tok/s


def _feed(view, until_s, policy_at_s=None):
    """Steps every STEP_S up to `until_s`, at each phase's concurrency as the batch."""
    t, ends = 0.0, []
    for _, d, c in PHASES:
        ends.append((sum(e for e, _ in ends[-1:]) + d if ends else d, c))
    while t < until_s - 1e-9:
        if policy_at_s is not None and t >= policy_at_s and view.policy is None:
            view.on_policy(POLICY)
        bs = next(c for e, c in ends if t < e)
        view.on_step(t, bs, 3, TOKENS_PER_STEP)
        t = round(t + STEP_S, 6)


def test_off_a_terminal_the_progress_is_one_line_per_phase():
    wl = parse_workload(WORKLOAD)
    out = io.StringIO()
    view = _Progress(wl, out=out, tty=False)
    _feed(view, 12.0, policy_at_s=5.0)
    view.finish()
    lines = out.getvalue().splitlines()
    assert len(lines) == len(PHASES), lines
    assert lines[0].startswith("[#####...........]  4/12 s  warm ")  # 4 of 12 s: 5 of 16 cells
    assert lines[1].startswith("[#############...] 10/12 s  surge")
    assert lines[2].startswith("[################] 12/12 s  cool ")
    for ln, (_, _, c) in zip(lines, PHASES):
        assert f"batch {c:>3}" in ln and "  200 tok/s  " in ln, ln  # the phase's mean batch and rate
    assert lines[0].endswith("policy: none yet (the engine's fallback)")
    assert lines[1].endswith("policy v7: 1-3:s3 4:s1 5+:off") and lines[2].endswith("policy v7: 1-3:s3 4:s1 5+:off")


def test_on_a_terminal_one_line_is_redrawn_and_each_phase_leaves_one(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    wl = parse_workload(WORKLOAD)
    out = io.StringIO()
    view = _Progress(wl, out=out, tty=True, every_s=0.0)
    _feed(view, 3.0)
    text = out.getvalue()
    assert "\n" not in text and text.count("\r\x1b[2K") >= 50  # redrawn in place, never scrolled
    shown = text.rsplit("\r\x1b[2K", 1)[1]
    assert shown.startswith("[####............]  3/12 s  warm   batch   2    200 tok/s")
    draws = text.split("\r\x1b[2K")[1:]
    assert max(len(d) for d in draws) == 59  # cut to the terminal's width: a wrapped line can't be redrawn
    out.truncate(0)
    out.seek(0)
    _feed(view, 12.0)
    view.finish()
    text = out.getvalue()
    assert text.count("\n") == len(PHASES) and text.endswith("\n")
    kept = [seg.rsplit("\r\x1b[2K", 1)[1] for seg in text.split("\n")[:-1]]
    assert [k.split()[3] for k in kept] == ["warm", "surge", "cool"]


@pytest.fixture(scope="module")
def report():
    prof, wl = load_profile("moe-1t-int4-tp8-pcie"), parse_workload(WORKLOAD)
    names = ["off", "static:s1", "static:s2", "static:s3", "threshold:5:s3", "sglang-ema", "adaptive", "oracle"]
    rep = simbench.run_bench(prof, wl, names, search=False)
    # the live run's place in the report, as the demo fills it (a wall-clock run is not needed to draw it)
    live = replace(next(r for r in rep.results if r.policy == "adaptive"), policy="adaptive-live")
    rep.results.insert(len(rep.results) - 1, live)
    rep.labels.insert(len(rep.labels) - 1, "live")
    return rep, wl


def test_the_verdict_lines_lead_with_the_operators_threshold(report):
    rep, _ = report
    by = {r.policy: r.tokens_per_s for r in rep.results}
    me = by["adaptive-live"]
    head, ratios = simbench.verdict_lines(rep, "adaptive-live", "threshold:5:s3")
    assert head == f"specctl {me:.1f} tok/s = {me / by['threshold:5:s3']:.3f}x the operator's threshold:5:s3"
    parts = ratios.split(" · ")
    assert parts[0] == f"{me / by['off']:.3f}x off (no speculation)" or parts[0].startswith(
        f"{me / by['off']:.3f}x off (no speculation, the best static)")
    assert parts[1] == f"{me / by['sglang-ema']:.3f}x SGLang's adaptive"
    assert parts[-1] == f"{me / by['oracle']:.3f}x the oracle"
    best = max(("off", "static:s1", "static:s2", "static:s3"), key=by.get)
    if best != "off":
        assert f"{me / by[best]:.3f}x the best static ({best})" in parts
    # with `off` the best static, it is named once
    only_off = replace(rep, results=[r for r in rep.results if not r.policy.startswith("static:")])
    _, ratios = simbench.verdict_lines(only_off, "adaptive-live", "threshold:5:s3")
    assert ratios.startswith(f"{me / by['off']:.3f}x off (no speculation, the best static) · ")
    assert "best static (" not in ratios


def test_the_page_a_newcomer_reads(report, tmp_path):
    import matplotlib.colors as mcolors

    rep, wl = report
    head, ratios = simbench.verdict_lines(rep, "adaptive-live", "threshold:5:s3")
    fig = simbench.figure(rep.results, head, "synthetic profile moe-1t-int4-tp8-pcie", ratios=ratios,
                          operator="threshold:5:s3", workload=wl)
    ax = {a.get_label(): a for a in fig.axes}
    # the verdict is the title, large
    title = next(t for t in fig.texts if t.get_text() == head)
    assert title.get_fontsize() >= 15
    assert any(t.get_text() == ratios for t in fig.texts) and any("synthetic" in t.get_text() for t in fig.texts)
    # five lines on the throughput, two on the decisions
    top = ax["throughput"].get_lines()
    assert len(top) == 5
    assert [ln.get_label().split(":")[0].split(" (")[0] for ln in top] == [
        "oracle", "off", "SGLang's adaptive", "the operator's threshold", "specctl live"]
    assert top[-1].get_color() == "black" and top[-1].get_linewidth() == max(ln.get_linewidth() for ln in top)
    assert top[0].get_linestyle() == "--"
    assert len(ax["decisions"].get_lines()) == 2
    # distinct colours, the batch's one no policy uses
    policy_colours = {mcolors.to_hex(ln.get_color()) for ln in top}
    assert len(policy_colours) == 5
    batch_colours = {mcolors.to_hex(ln.get_color()) for ln in ax["load"].get_lines()}
    assert batch_colours and not batch_colours & policy_colours
    # phases shaded alternately on every panel and named above the top one, readable
    for name in ("throughput", "decisions", "load"):
        assert len(ax[name].patches) == (len(PHASES) + 1) // 2
    labels = [t for t in ax["throughput"].texts if t.get_text().split("\n")[0] in {n for n, _, _ in PHASES}]
    assert len(labels) == len(PHASES) and min(t.get_fontsize() for t in labels) >= 9
    assert labels[1].get_text() in ("surge\ncode+chat, 32 at a time", "surge\nchat+code, 32 at a time")
    # every policy's whole-run figure, ranked
    ranked = [t.get_text() for t in ax["ranking"].get_yticklabels()]
    assert len(ranked) == len(rep.results)
    assert {"specctl live", "static:s1", "static:s2", "static:s3"} <= set(ranked)
    png = tmp_path / "demo.png"
    simbench.plot(rep.results, png, head, operator="threshold:5:s3", workload=wl)
    assert png.read_bytes()[:4] == b"\x89PNG"
