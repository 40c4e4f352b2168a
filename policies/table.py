"""The batch-size -> configuration table every policy emits and every engine rank looks up.

Pure data (stdlib only): configurations are `(steps, topk, draft_tokens)` tuples; the table is
built from the policy JSON of docs/architecture.md (a dict) so that the plugin and the simulator share it.
Optional context bands: rows naming `min_ctx` / `max_ctx` (mean context tokens per request of the
batch) form one gap-free table per band; rows naming neither serve any context.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

Config = tuple[int, int, int]  # (steps, topk, draft_tokens)
OFF: Config = (0, 1, 1)


def chain(steps: int) -> Config:
    return OFF if steps == 0 else (steps, 1, steps + 1)


def config_name(c: Config) -> str:
    if c[0] == 0:
        return "off"
    return f"s{c[0]}" if c[1] == 1 else f"s{c[0]}k{c[1]}n{c[2]}"


def config_to_obj(c: Config) -> dict[str, int]:
    return {"steps": c[0], "topk": c[1], "draft_tokens": c[2]}


def config_from_obj(obj: Mapping[str, Any]) -> Config:
    return (int(obj["steps"]), int(obj["topk"]), int(obj["draft_tokens"]))


@dataclass(frozen=True)
class Row:
    min_batch: int
    max_batch: Optional[int]  # None = open-ended (last row)
    config: Config
    # exploring and challenging rows only: the row covers batches whose mean context per request is
    # in [min_ctx, max_ctx] (None: no bound; both None: any context). A table's rows are grouped in Bands.
    min_ctx: Optional[int] = None
    max_ctx: Optional[int] = None


@dataclass(frozen=True)
class Band:
    """The rows for batches whose mean context tokens per request lie in [min_ctx, max_ctx]
    (max_ctx None: no upper bound); the rows cover every batch size from 1, like a table's."""

    min_ctx: int
    max_ctx: Optional[int]
    rows: tuple[Row, ...]

    def covers(self, mean_ctx: int) -> bool:
        return self.min_ctx <= mean_ctx and (self.max_ctx is None or mean_ctx <= self.max_ctx)


def ctx_band_index(mean_ctx: int) -> int:
    """Power-of-2 context band of a mean context length: 0 = [0, 1], k = [2**k, 2**(k+1) - 1]."""
    return max(0, int(mean_ctx).bit_length() - 1)


def ctx_band_range(k: int) -> tuple[int, int]:
    return (0, 1) if k <= 0 else (1 << k, (1 << (k + 1)) - 1)


def mean_ctx(ctx_tokens: int, batch_size: int) -> int:
    """Mean context tokens per request of a batch (what min_ctx / max_ctx are compared with)."""
    return int(ctx_tokens) // max(1, int(batch_size))


def rows_from_obj(items: Iterable[Mapping[str, Any]], *, with_ctx: bool = True) -> tuple[Row, ...]:
    """Rows from their JSON form (docs/architecture.md) (`min_batch`, `max_batch` or null, `config`, and for
    exploring rows optionally `min_ctx` / `max_ctx`; `with_ctx` False drops those)."""
    def opt(r: Mapping[str, Any], k: str) -> Optional[int]:
        v = r.get(k) if with_ctx else None
        return None if v is None else int(v)

    return tuple(Row(int(r["min_batch"]), None if r.get("max_batch") is None else int(r["max_batch"]),
                     config_from_obj(r["config"]), opt(r, "min_ctx"), opt(r, "max_ctx")) for r in items)


def rows_to_obj(rows: Iterable[Row]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        o: dict[str, Any] = {"min_batch": r.min_batch, "max_batch": r.max_batch, "config": config_to_obj(r.config)}
        if r.min_ctx is not None:
            o["min_ctx"] = r.min_ctx
        if r.max_ctx is not None:
            o["max_ctx"] = r.max_ctx
        out.append(o)
    return out


def split_table_obj(items: Iterable[Mapping[str, Any]]) -> tuple[tuple[Row, ...], tuple[Band, ...]]:
    """A policy's `table` list -> (rows naming no context, context bands in list order). Rows of
    one band must be consecutive in the list."""
    plain: list[Mapping[str, Any]] = []
    groups: list[tuple[tuple[int, Optional[int]], list[Mapping[str, Any]]]] = []
    last: Any = ()
    for r in items:
        lo, hi = r.get("min_ctx"), r.get("max_ctx")
        key = None if lo is None and hi is None else (0 if lo is None else int(lo), None if hi is None else int(hi))
        if key is None:
            plain.append(r)
        elif last == key:
            groups[-1][1].append(r)
        elif any(k == key for k, _ in groups):
            raise ValueError(f"the rows of context band {_band_text(*key)} are not consecutive")
        else:
            groups.append((key, [r]))
        last = key
    return (rows_from_obj(plain, with_ctx=False),
            tuple(Band(k[0], k[1], rows_from_obj(g, with_ctx=False)) for k, g in groups))


def bands_to_obj(bands: Iterable[Band]) -> list[dict[str, Any]]:
    out = []
    for band in bands:
        for r in rows_to_obj(band.rows):
            r["min_ctx"] = band.min_ctx
            if band.max_ctx is not None:
                r["max_ctx"] = band.max_ctx
            out.append(r)
    return out


def _band_text(lo: int, hi: Optional[int]) -> str:
    return f"{lo}+" if hi is None else f"{lo}-{hi}"


@dataclass(frozen=True)
class PolicyTable:
    """Sorted, gap-free rows from batch 1 up; the last row is open-ended.

    `explore` rows name (range, config) pairs the controller wants measured; `decide` uses one of
    them on the steps where `step_counter % explore_period == 0`, so every TP rank, counting the
    same steps, makes the same choice with no random draw.

    `bands` (optional, sorted, disjoint): per range of mean context tokens per request, rows used
    instead of `rows` for a batch whose context is known and falls in the band; `rows` serve the
    batches whose context is unknown or outside every band.
    """

    rows: tuple[Row, ...]
    explore: tuple[Row, ...] = ()
    explore_period: int = 0
    version: int = 0
    source: str = "fixed"
    bands: tuple[Band, ...] = ()
    _starts: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _band_lo: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _band_starts: tuple[tuple[int, ...], ...] = field(default=(), repr=False, compare=False)
    uses_ctx: bool = field(default=False, repr=False, compare=False, init=False)  # bands or banded rows

    def __post_init__(self) -> None:
        why = table_problem(self.rows) or bands_problem(self.bands)
        if why:
            raise ValueError(why)
        object.__setattr__(self, "_starts", tuple(r.min_batch for r in self.rows))
        object.__setattr__(self, "_band_lo", tuple(b.min_ctx for b in self.bands))
        object.__setattr__(self, "_band_starts", tuple(tuple(r.min_batch for r in b.rows) for b in self.bands))
        object.__setattr__(self, "uses_ctx", bool(self.bands) or any(
            r.min_ctx is not None or r.max_ctx is not None for r in self.explore))

    @classmethod
    def from_rows(cls, rows: Iterable[tuple[int, Optional[int], Config]], **kw: Any) -> "PolicyTable":
        return cls(rows=tuple(Row(a, b, tuple(c)) for a, b, c in rows), **kw)  # type: ignore[arg-type]

    @classmethod
    def from_policy_obj(cls, obj: Mapping[str, Any]) -> "PolicyTable":
        """From the policy JSON (docs/architecture.md) (already parsed into dicts)."""
        rows, bands = split_table_obj(obj["table"])
        return cls(rows=rows, explore=rows_from_obj(obj.get("explore") or ()),
                   explore_period=int(obj.get("explore_period") or 0),
                   version=int(obj.get("version", 0)), source=str(obj.get("source", "file")),
                   bands=bands)

    def lookup(self, batch_size: int, ctx_tokens: Optional[int] = None) -> Config:
        """The row covering batch_size: of the band covering the batch's mean context when
        ctx_tokens (the batch's context tokens, all requests) is known, else of `rows`."""
        if ctx_tokens is not None and self.bands:
            k = self.band_index(mean_ctx(ctx_tokens, batch_size))
            if k is not None:
                starts = self._band_starts[k]
                return self.bands[k].rows[bisect.bisect_right(starts, max(1, batch_size)) - 1].config
        i = bisect.bisect_right(self._starts, max(1, batch_size)) - 1
        return self.rows[i].config

    def band_index(self, mean_ctx_tokens: int) -> Optional[int]:
        """Index of the band covering this mean context per request, or None."""
        k = bisect.bisect_right(self._band_lo, mean_ctx_tokens) - 1
        if k < 0:
            return None
        hi = self.bands[k].max_ctx
        return k if hi is None or mean_ctx_tokens <= hi else None

    def rows_for(self, mean_ctx_tokens: Optional[int]) -> tuple[Row, ...]:
        """The rows a batch of this mean context per request (None: unknown) is looked up in."""
        k = None if mean_ctx_tokens is None else self.band_index(mean_ctx_tokens)
        return self.rows if k is None else self.bands[k].rows

    def decide(self, batch_size: int, step_counter: int, ctx_tokens: Optional[int] = None) -> Config:
        if self.explore and self.explore_period > 0 and step_counter % self.explore_period == 0:
            c = _rotate(self.explore, self.explore_period, batch_size, step_counter, ctx_tokens)
            if c is not None:
                return c
        return self.lookup(batch_size, ctx_tokens)

    def configs(self) -> list[Config]:
        out: list[Config] = []
        for r in self.rows + self.explore + tuple(r for b in self.bands for r in b.rows):
            if r.config not in out:
                out.append(r.config)
        return out

    def to_rows_obj(self) -> list[dict[str, Any]]:
        """The policy's `table` list: the rows naming no context, then each band's rows."""
        return rows_to_obj(self.rows) + bands_to_obj(self.bands)

    def boundaries(self) -> list[tuple[int, Config, Config]]:
        """(first batch of the new row, config before, config after) for each change."""
        return [(b.min_batch, a.config, b.config) for a, b in zip(self.rows, self.rows[1:])]

    def spec_off_crossover(self) -> Optional[int]:
        """First batch size from which the table never speculates again, or None."""
        last_spec = None
        for r in self.rows:
            if r.config[0] > 0:
                last_spec = r
        if last_spec is None:
            return 1
        if last_spec.max_batch is None:
            return None
        return last_spec.max_batch + 1


def _in(r: Row, b: int, ctx_tokens: Optional[int] = None) -> bool:
    if not (r.min_batch <= b and (r.max_batch is None or b <= r.max_batch)):
        return False
    if r.min_ctx is None and r.max_ctx is None:
        return True
    if ctx_tokens is None:
        return False  # a row for a context band covers no batch of unknown context
    m = mean_ctx(ctx_tokens, b)
    return (r.min_ctx or 0) <= m and (r.max_ctx is None or m <= r.max_ctx)


def _rotate(rows: Sequence[Row], period: int, b: int, step_counter: int,
            ctx_tokens: Optional[int] = None) -> Optional[Config]:
    """The rows covering batch size b (and the batch's context, for rows of a context band) in
    turn, one per `period` steps; None if none covers it."""
    hits = [r for r in rows if _in(r, b, ctx_tokens)]
    return hits[(step_counter // period) % len(hits)].config if hits else None


def table_problem(rows: Sequence[Row]) -> Optional[str]:
    """Why these rows are not a valid table (gap, overlap, not open-ended), or None."""
    if not rows:
        return "empty policy table"
    expect = 1
    for i, r in enumerate(rows):
        if r.min_batch != expect:
            return f"table row {i} starts at batch {r.min_batch}, expected {expect}"
        if r.max_batch is None:
            return None if i == len(rows) - 1 else f"table row {i} is open-ended but not last"
        if r.max_batch < r.min_batch:
            return f"table row {i} ends before it starts"
        expect = r.max_batch + 1
    return "the last table row must be open-ended"


def bands_problem(bands: Sequence[Band]) -> Optional[str]:
    """Why these context bands are not valid (a band's rows are not a table, bands overlap or
    are out of order), or None."""
    prev_hi: Optional[int] = -1
    for band in bands:
        name = _band_text(band.min_ctx, band.max_ctx)
        if band.min_ctx < 0 or (band.max_ctx is not None and band.max_ctx < band.min_ctx):
            return f"context band {name} is empty or negative"
        if prev_hi is None or band.min_ctx <= prev_hi:
            return f"context band {name} overlaps or precedes the band before it"
        why = table_problem(band.rows)
        if why:
            return f"context band {name}: {why}"
        prev_hi = band.max_ctx
    return None


def rows_from_choices(choices: Sequence[Config]) -> tuple[Row, ...]:
    """Compress a per-batch-size choice list (index 0 = batch 1) into rows; the last choice
    extends to infinity."""
    rows: list[Row] = []
    start = 1
    for b in range(2, len(choices) + 1):
        if choices[b - 1] != choices[b - 2]:
            rows.append(Row(start, b - 1, choices[b - 2]))
            start = b
    rows.append(Row(start, None, choices[-1]))
    return tuple(rows)
