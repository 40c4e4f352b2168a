"""The batch-size -> configuration table every policy emits and every engine rank looks up.

Pure data (stdlib only): configurations are `(steps, topk, draft_tokens)` tuples; the table is
built from the DESIGN.md policy JSON (a dict) so that the plugin and the simulator share it.
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


def rows_from_obj(items: Iterable[Mapping[str, Any]]) -> tuple[Row, ...]:
    """Rows from their DESIGN.md JSON form (`min_batch`, `max_batch` or null, `config`)."""
    return tuple(Row(int(r["min_batch"]), None if r.get("max_batch") is None else int(r["max_batch"]),
                     config_from_obj(r["config"])) for r in items)


def rows_to_obj(rows: Iterable[Row]) -> list[dict[str, Any]]:
    return [{"min_batch": r.min_batch, "max_batch": r.max_batch, "config": config_to_obj(r.config)}
            for r in rows]


@dataclass(frozen=True)
class PolicyTable:
    """Sorted, gap-free rows from batch 1 up; the last row is open-ended.

    `explore` rows name (range, config) pairs the controller wants measured; `decide` uses one of
    them on the steps where `step_counter % explore_period == 0`, so every TP rank, counting the
    same steps, makes the same choice with no random draw. `challenge` rows (a configuration
    that looks better than the table's choice in a range, by less than the controller can tell
    from noise) are used likewise on the other steps where `step_counter % challenge_period ==
    0`.
    """

    rows: tuple[Row, ...]
    explore: tuple[Row, ...] = ()
    explore_period: int = 0
    challenge: tuple[Row, ...] = ()
    challenge_period: int = 0
    version: int = 0
    source: str = "fixed"
    _starts: tuple[int, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        why = table_problem(self.rows)
        if why:
            raise ValueError(why)
        object.__setattr__(self, "_starts", tuple(r.min_batch for r in self.rows))

    @classmethod
    def from_rows(cls, rows: Iterable[tuple[int, Optional[int], Config]], **kw: Any) -> "PolicyTable":
        return cls(rows=tuple(Row(a, b, tuple(c)) for a, b, c in rows), **kw)  # type: ignore[arg-type]

    @classmethod
    def from_policy_obj(cls, obj: Mapping[str, Any]) -> "PolicyTable":
        """From the DESIGN.md policy JSON (already parsed into dicts)."""
        return cls(rows=rows_from_obj(obj["table"]), explore=rows_from_obj(obj.get("explore") or ()),
                   explore_period=int(obj.get("explore_period") or 0),
                   challenge=rows_from_obj(obj.get("challenge") or ()),
                   challenge_period=int(obj.get("challenge_period") or 0),
                   version=int(obj.get("version", 0)), source=str(obj.get("source", "file")))

    def lookup(self, batch_size: int) -> Config:
        i = bisect.bisect_right(self._starts, max(1, batch_size)) - 1
        return self.rows[i].config

    def decide(self, batch_size: int, step_counter: int) -> Config:
        if self.explore and self.explore_period > 0 and step_counter % self.explore_period == 0:
            c = _rotate(self.explore, self.explore_period, batch_size, step_counter)
            if c is not None:
                return c
        if self.challenge and self.challenge_period > 0 and step_counter % self.challenge_period == 0:
            c = _rotate(self.challenge, self.challenge_period, batch_size, step_counter)
            if c is not None:
                return c
        return self.lookup(batch_size)

    def configs(self) -> list[Config]:
        out: list[Config] = []
        for r in self.rows + self.explore + self.challenge:
            if r.config not in out:
                out.append(r.config)
        return out

    def to_rows_obj(self) -> list[dict[str, Any]]:
        return rows_to_obj(self.rows)

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


def _in(r: Row, b: int) -> bool:
    return r.min_batch <= b and (r.max_batch is None or b <= r.max_batch)


def _rotate(rows: Sequence[Row], period: int, b: int, step_counter: int) -> Optional[Config]:
    """The rows covering batch size b in turn, one per `period` steps; None if none covers it."""
    hits = [r for r in rows if _in(r, b)]
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
