"""Human views of a policy: the table with the goodput behind each choice, its context bands, and a
plot."""

from __future__ import annotations

import time
from typing import Any, Optional

from . import wire


def _goodput_at(model: dict[str, Any], name: str, b: int) -> Optional[float]:
    pts = (model.get("predicted_goodput_tok_s") or {}).get(name)
    if not pts:
        return None
    # log-spaced probes: take the nearest probe at or below b (interpolate linearly)
    lo = None
    for pb, g in pts:
        if pb <= b:
            lo = (pb, g)
        elif lo is not None:
            return lo[1] + (g - lo[1]) * (b - lo[0]) / (pb - lo[0])
        else:
            return g
    return lo[1] if lo else None


def _samples_in(model: dict[str, Any], name: str, lo: int, hi: Optional[int]) -> Optional[float]:
    cfg = (model.get("configs") or {}).get(name)
    if not cfg or "regions" not in cfg:
        return None
    total = 0.0
    for r in cfg["regions"]:
        if r["max_batch"] >= lo and (hi is None or r["min_batch"] <= hi):
            total += r["samples"]
    return total


def render(policy: wire.PolicyRecord, *, now: Optional[float] = None) -> str:
    now = time.time() if now is None else now
    m = policy.model or {}
    age = max(0.0, now - policy.created_at)
    lines = [
        f"policy v{policy.version}  source={policy.source}  age={_age(age)}  "
        f"evidence={m.get('evidence', 'n/a')}  samples={m.get('samples', 0)}",
    ]
    names = sorted((m.get("predicted_goodput_tok_s") or {}).keys(), key=_order)
    header = f"{'batch size':>12}  {'config':<10}"
    for n in names:
        header += f"  {n + ' tok/s':>12}"
    header += f"  {'samples':>8}"
    lines.append(header)
    lines.append("-" * len(header))
    banded = [r for r in policy.table if r.ctx_band is not None]
    for row in policy.table:
        if row.ctx_band is not None:
            continue
        rng = f"{row.min_batch}-{row.max_batch}" if row.max_batch is not None else f"{row.min_batch}+"
        name = row.config.name
        line = f"{rng:>12}  {name:<10}"
        mid = row.min_batch if row.max_batch is None else (row.min_batch + row.max_batch) // 2
        for n in names:
            g = _goodput_at(m, n, mid)
            cell = "-" if g is None else f"{g:,.0f}"
            if n == name:
                cell = "*" + cell
            line += f"  {cell:>12}"
        s = _samples_in(m, name, row.min_batch, row.max_batch)
        line += f"  {'-' if s is None else f'{s:,.0f}':>8}"
        lines.append(line)
    if names:
        lines.append("(goodput predicted at each range's midpoint; * = chosen)")
    if banded:
        lines += _band_lines(banded, m)
    if policy.explore:
        lines.append(f"exploring 1 step in {policy.explore_period}: {_ranges(policy.explore)}")
    cfgs = m.get("configs") or {}
    if cfgs:
        parts = []
        for n in sorted(cfgs, key=_order):
            tau = cfgs[n].get("tokens_per_step")
            if tau is not None and n != "off":
                parts.append(f"{n} tau={tau:.2f}")
        if parts:
            lines.append("tokens/step: " + ", ".join(parts))
    paths = m.get("off_paths") or {}
    if paths:
        said = {"decode": "decode state", "verify": "trivial verify", "unknown": "not said"}
        order = sorted(paths, key=lambda k: (list(said).index(k) if k in said else len(said), k))
        lines.append("off steps ran: " + ", ".join(f"{said.get(k, k)} {paths[k]:,}" for k in order))
    if m.get("fit_error"):
        lines.append("fit error (median rel.): " + ", ".join(
            f"{k} {v:.1%}" for k, v in sorted(m["fit_error"].items(), key=lambda kv: _order(kv[0]))))
    return "\n".join(lines)


def _band_lines(rows: list[wire.TableEntry], model: dict[str, Any]) -> list[str]:
    """One line per context band: its rows, and its spec->off crossover."""
    bands: dict[tuple[int, Optional[int]], list[wire.TableEntry]] = {}
    for r in rows:
        bands.setdefault(r.ctx_band, []).append(r)  # type: ignore[arg-type]
    out = ["context bands (mean context tokens per request; the rows above serve batches of unknown context):"]
    for (lo, hi), rs in bands.items():
        name = f"context {lo}+" if hi is None else f"context {lo}-{hi}"
        cells = ", ".join(f"{r.config.name} {r.min_batch}{'+' if r.max_batch is None else f'-{r.max_batch}'}"
                          for r in rs[:12]) + (f" (+{len(rs) - 12} more)" if len(rs) > 12 else "")
        last_spec = max((r for r in rs if not r.config.is_off), key=lambda r: r.min_batch, default=None)
        x = 1 if last_spec is None else (None if last_spec.max_batch is None else last_spec.max_batch + 1)
        out.append(f"{name:>18}  {cells}  (spec->off at {'never' if x is None else f'batch {x}'})")
    for b in model.get("ctx_bands") or []:
        if b.get("predicted_at_ctx") is not None:
            out.append("(each band's table is chosen at the predicted step time of its busiest power-of-2 "
                       "band's middle context)")
            break
    return out


def _ranges(rows: list[wire.TableEntry], most: int = 12) -> str:
    text = ", ".join(f"{r.config.name}@{r.min_batch}-{r.max_batch if r.max_batch else '+'}" for r in rows[:most])
    return text + (f" (+{len(rows) - most} more)" if len(rows) > most else "")


def _order(name: str) -> tuple[int, str]:
    if name == "off":
        return (0, "")
    digits = "".join(ch for ch in name[1:] if ch.isdigit())
    return (int(digits[:2] or 0) if name.startswith("s") else 99, name)


def _age(s: float) -> str:
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


def plot(policy: wire.PolicyRecord, out_png: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # optional extra
        raise RuntimeError("plotting needs matplotlib: pip install 'specctl[plot]'") from e
    m = policy.model or {}
    curves = m.get("predicted_goodput_tok_s") or {}
    if not curves:
        raise RuntimeError("this policy carries no goodput predictions to plot (no fit yet)")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in sorted(curves, key=_order):
        pts = curves[name]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
    env_b, env_g = [], []
    for b in sorted({p[0] for pts in curves.values() for p in pts}):
        env_b.append(b)
        env_g.append(max(g for pts in curves.values() for pb, g in pts if pb == b))
    ax.plot(env_b, env_g, color="k", lw=2.5, alpha=0.25, label="envelope")
    plain = [r for r in policy.table if r.ctx_band is None]
    for row in plain[1:]:
        ax.axvline(row.min_batch, color="grey", ls=":", lw=1)
        ax.text(row.min_batch, ax.get_ylim()[1] * 0.97, f" {row.config.name}", fontsize=8, va="top")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("predicted goodput (tokens/s)")
    ax.set_title(f"specctl policy v{policy.version} ({policy.source})")
    ax.legend(fontsize=8)
    banded = [r for r in policy.table if r.ctx_band is not None]
    if banded:
        fig.set_size_inches(14, 4.5)
        ax2 = fig.add_subplot(1, 2, 2)
        ax.set_position([0.06, 0.12, 0.40, 0.78])
        _plot_bands(ax2, banded, plain)
    else:
        fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def _plot_bands(ax: Any, banded: list[wire.TableEntry], plain: list[wire.TableEntry]) -> None:
    """The configuration per (mean context, batch size): one column of rectangles per band."""
    from matplotlib.patches import Patch, Rectangle

    names = sorted({r.config.name for r in banded + plain}, key=_order)
    colors = {n: f"C{i}" for i, n in enumerate(names)}
    top_b = max([2 * r.min_batch for r in banded] + [64])
    lows = [r.ctx_band[0] for r in banded if r.ctx_band[0] > 0] or [2]  # type: ignore[index]
    top_c = max([r.ctx_band[1] or 2 * max(lows) for r in banded] + [2 * max(lows)])  # type: ignore[index]
    for r in banded:
        lo, hi = r.ctx_band  # type: ignore[misc]
        lo, hi = max(1, min(lows) // 4) if lo == 0 else lo, (top_c if hi is None else hi + 1)
        b0, b1 = r.min_batch, (top_b if r.max_batch is None else r.max_batch + 1)
        ax.add_patch(Rectangle((lo, b0), hi - lo, b1 - b0, color=colors[r.config.name], alpha=0.6, lw=0))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlim(max(1, min(lows) // 4), top_c)  # the band from 0 shown from a quarter of the next one's start
    ax.set_ylim(1, top_b)
    ax.set_xlabel("mean context tokens per request")
    ax.set_ylabel("batch size")
    ax.set_title("configuration by context band")
    ax.legend(handles=[Patch(color=colors[n], alpha=0.6, label=n) for n in names], fontsize=8)
