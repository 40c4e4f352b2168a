"""Versioned wire records: the per-step telemetry record and the published policy.

One ZeroMQ frame carries one record, UTF-8 JSON, exactly the form of docs/architecture.md (also the `.jsonl`
line format of recordings):

    frame := {"kind": "step",   "schema": 1, ...}     engine -> daemon (PUSH/PULL)
           | {"kind": "policy", "schema": 1, ...}     daemon -> engine (PUB/SUB), file, status reply

Validation is strict (`extra="forbid"`, schema version checked, bounded lists, finite numbers);
new fields may only be added as optional ones.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from ..policies import table
# the one vocabulary (policies.table): configuration names, re-exported for wire's users
from ..policies.table import config_name, config_to_obj  # noqa: F401

SCHEMA_VERSION = 1
MAX_BATCH_SIZE = 65536  # bounds every per-request list on the wire
MAX_STEPS = 64
MAX_TOPK = 64
MAX_DRAFT_TOKENS = 4096
MAX_TABLE_ROWS = 1024
MAX_FRAME_BYTES = 4 * 1024 * 1024


class WireError(ValueError):
    """A frame that is not a valid record; `reason` is a short metric label."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class _Versioned(_Strict):
    """A top-level record: `kind` discriminates, `schema` must be the version this build reads."""

    kind: str
    schema_: int = Field(alias="schema", default=SCHEMA_VERSION)

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True)

    @field_validator("schema_")
    @classmethod
    def _schema(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise ValueError(f"unsupported schema version {v} (this build reads {SCHEMA_VERSION})")
        return v


class SpecConfig(_Strict):
    """One speculative configuration; steps == 0 is plain decode."""

    steps: int = Field(ge=0, le=MAX_STEPS)
    topk: int = Field(ge=1, le=MAX_TOPK)
    draft_tokens: int = Field(ge=1, le=MAX_DRAFT_TOKENS)

    @model_validator(mode="after")
    def _consistent(self) -> "SpecConfig":
        if self.steps == 0 and (self.topk != 1 or self.draft_tokens != 1):
            raise ValueError("steps=0 (plain decode) needs topk=1 and draft_tokens=1")
        if self.steps > 0 and self.topk == 1 and self.draft_tokens != self.steps + 1:
            raise ValueError(
                f"a chain (topk=1) with steps={self.steps} verifies draft_tokens=steps+1="
                f"{self.steps + 1}, not {self.draft_tokens}"
            )
        if self.steps > 0 and self.draft_tokens < 2:
            raise ValueError("a speculative configuration verifies at least 2 tokens")
        return self

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.steps, self.topk, self.draft_tokens)

    @property
    def name(self) -> str:
        return config_name(self.key)

    @property
    def is_off(self) -> bool:
        return self.steps == 0


OFF = SpecConfig(**config_to_obj(table.OFF))  # the table's OFF, validated as a wire record


def parse_config(text: str) -> SpecConfig:
    """`steps,topk,draft_tokens` (CLI form), `off`, `sN` (chain) or `sNkKnD`."""
    t = text.strip().lower()
    try:
        if t in ("off", "0", "0,1,1"):
            return OFF
        if "," in t:
            steps, topk, draft = (int(x) for x in t.split(","))
            return SpecConfig(steps=steps, topk=topk, draft_tokens=draft)
        if t.startswith("s") and "k" in t and "n" in t:
            steps = int(t[1 : t.index("k")])
            topk = int(t[t.index("k") + 1 : t.index("n")])
            draft = int(t[t.index("n") + 1 :])
            return SpecConfig(steps=steps, topk=topk, draft_tokens=draft)
        if t.startswith("s"):
            steps = int(t[1:])
            return SpecConfig(steps=steps, topk=1, draft_tokens=steps + 1)
    except ValidationError as e:
        raise ValueError(f"invalid configuration {text!r}: {_first_error(e)}") from None
    except ValueError:
        pass
    raise ValueError(
        f"invalid configuration {text!r}: expected 'steps,topk,draft_tokens', 'off', 'sN' or 'sNkKnD'"
    )


class StepRecord(_Versioned):
    """Telemetry: one decode step of one engine rank."""

    kind: Literal["step"] = "step"
    server: str = Field(min_length=1, max_length=128)
    rank: int = Field(ge=0, le=65535)
    iter: int = Field(ge=0)
    ts: float = Field(ge=0)
    batch_size: int = Field(ge=1, le=MAX_BATCH_SIZE)
    config: SpecConfig
    accepted: Optional[list[Annotated[int, Field(ge=0, le=MAX_STEPS)]]] = Field(
        default=None, max_length=MAX_BATCH_SIZE
    )
    step_ms: float = Field(gt=0, lt=600_000)
    ctx_tokens: Optional[int] = Field(default=None, ge=0)
    # steps 0 only: which "off" ran inside the EAGLE server ("decode": the plugin's decode state,
    # "verify": SGLang's 1-token trivial verify); absent from engines that do not say
    off_path: Optional[Literal["decode", "verify"]] = None

    @model_validator(mode="after")
    def _accepted_fits(self) -> "StepRecord":
        if self.off_path is not None and self.config.steps != 0:
            raise ValueError("off_path is only for steps=0 records")
        acc = self.accepted
        if acc is None:
            if self.config.steps > 0:
                raise ValueError("accepted is required when steps > 0")
            return self
        if len(acc) != self.batch_size:
            raise ValueError(
                f"accepted has {len(acc)} entries for batch_size {self.batch_size}"
            )
        if acc and max(acc) > self.config.steps:
            raise ValueError(
                f"accepted {max(acc)} drafts with only steps={self.config.steps}"
            )
        return self


class TableEntry(_Strict):
    """One row. `min_ctx` / `max_ctx` (optional, inclusive): the row serves batches whose mean
    context tokens per request lies in that range (absent: no bound); a row naming neither
    serves any context."""

    min_batch: int = Field(ge=1)
    max_batch: Optional[int] = Field(default=None, ge=1)
    config: SpecConfig
    min_ctx: Optional[int] = Field(default=None, ge=0)
    max_ctx: Optional[int] = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> "TableEntry":
        if self.max_batch is not None and self.max_batch < self.min_batch:
            raise ValueError(f"max_batch {self.max_batch} < min_batch {self.min_batch}")
        if self.max_ctx is not None and self.max_ctx < (self.min_ctx or 0):
            raise ValueError(f"max_ctx {self.max_ctx} < min_ctx {self.min_ctx or 0}")
        return self

    @property
    def ctx_band(self) -> Optional[tuple[int, Optional[int]]]:
        """(min_ctx, max_ctx) of the band this row belongs to, None for a row of any context."""
        if self.min_ctx is None and self.max_ctx is None:
            return None
        return (self.min_ctx or 0, self.max_ctx)


class PolicyRecord(_Versioned):
    """The batch-size -> configuration table, as published, persisted and printed.

    `explore` (optional) lists batch-size ranges where a configuration is worth measuring (the
    daemon's exploration rule); the engine uses it on one step in `explore_period`, chosen by its
    step counter (same on every TP rank). `challenge` / `challenge_period`: written by daemons
    before the one exploration rule; accepted (still validated) and ignored.
    `table` rows naming `min_ctx` / `max_ctx` form context bands (see check_table_covers); an
    exploring row naming them covers only batches of that mean context.
    """

    kind: Literal["policy"] = "policy"
    version: int = Field(ge=0)
    created_at: float = Field(ge=0)
    source: Literal["online", "fixed", "file"]
    table: list[TableEntry] = Field(min_length=1, max_length=MAX_TABLE_ROWS)
    model: dict[str, Any] = Field(default_factory=dict)
    explore: Optional[list[TableEntry]] = Field(default=None, max_length=MAX_TABLE_ROWS)
    explore_period: Optional[int] = Field(default=None, ge=50)
    challenge: Optional[list[TableEntry]] = Field(default=None, max_length=MAX_TABLE_ROWS)
    challenge_period: Optional[int] = Field(default=None, ge=8)

    @model_validator(mode="after")
    def _covers(self) -> "PolicyRecord":
        check_table_covers(self.table)
        return self

    def configs(self) -> list[SpecConfig]:
        seen: dict[tuple[int, int, int], SpecConfig] = {}
        for row in list(self.table) + list(self.explore or []):
            seen.setdefault(row.config.key, row.config)
        return list(seen.values())


def check_table_covers(table: list[TableEntry]) -> None:
    """The rows naming no context cover every batch size from 1 without gaps (the last is
    open-ended); so do the rows of each context band. Each group's rows are consecutive in the
    list; bands come in increasing, disjoint context ranges."""
    groups: list[tuple[Optional[tuple[int, Optional[int]]], list[tuple[int, TableEntry]]]] = []
    for i, row in enumerate(table):
        band = row.ctx_band
        if groups and groups[-1][0] == band:
            groups[-1][1].append((i, row))
        elif band is not None and any(g[0] == band for g in groups):
            raise ValueError(f"table row {i}: the rows of context band {_band_name(band)} are not consecutive")
        elif band is None and groups and any(g[0] is None for g in groups):
            raise ValueError(f"table row {i}: the rows naming no context are not consecutive")
        else:
            groups.append((band, [(i, row)]))
    if not any(g[0] is None for g in groups):
        raise ValueError("the table needs rows naming no context (they serve batches of unknown context)")
    prev_hi: Optional[int] = -1
    for band, rows in groups:
        _check_covers(rows, "" if band is None else f" (context band {_band_name(band)})")
        if band is None:
            continue
        if prev_hi is None or band[0] <= prev_hi:
            raise ValueError(f"context band {_band_name(band)} overlaps or precedes the band before it")
        prev_hi = band[1]


def _check_covers(rows: list[tuple[int, TableEntry]], where: str) -> None:
    expect = 1
    for k, (i, row) in enumerate(rows):
        if row.min_batch != expect:
            raise ValueError(
                f"table row {i} starts at batch {row.min_batch}, expected {expect} (no gaps, no overlap){where}"
            )
        if row.max_batch is None:
            if k != len(rows) - 1:
                raise ValueError(f"table row {i} is open-ended but is not the last row{where}")
            return
        expect = row.max_batch + 1
    raise ValueError(f"the last table row must be open-ended (max_batch null){where}")


def _band_name(band: tuple[int, Optional[int]]) -> str:
    return f"{band[0]}+" if band[1] is None else f"{band[0]}-{band[1]}"


Record = Annotated[Union[StepRecord, PolicyRecord], Field(discriminator="kind")]
_RECORD = TypeAdapter(Record)
_POLICY = TypeAdapter(PolicyRecord)


def _first_error(e: ValidationError) -> str:
    err = e.errors(include_url=False)[0]
    loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("step", "policy"))
    msg = err.get("msg", "invalid")
    return f"{loc}: {msg}" if loc else msg


def _reason(e: ValidationError) -> str:
    err = e.errors(include_url=False)[0]
    t = err.get("type", "")
    msg = err.get("msg", "")
    if t == "json_invalid":
        return "bad_json"
    if "schema version" in msg:
        return "bad_schema_version"
    if t in ("union_tag_invalid", "union_tag_not_found"):
        return "bad_kind"
    if t == "extra_forbidden":
        return "unknown_field"
    if t == "missing":
        return "missing_field"
    return "bad_value"


def _validate(adapter: TypeAdapter, frame: bytes | str) -> Any:
    if len(frame) > MAX_FRAME_BYTES:
        raise WireError("too_large", f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return adapter.validate_json(frame)
    except ValidationError as e:
        raise WireError(_reason(e), _first_error(e)) from None


def decode(frame: bytes | str) -> StepRecord | PolicyRecord:
    """Parse one frame into a record; raises WireError(reason, detail) on anything else."""
    return _validate(_RECORD, frame)


def decode_step(frame: bytes | str) -> StepRecord:
    """A telemetry frame: `kind` must be present and be "step"."""
    rec = _validate(_RECORD, frame)
    if not isinstance(rec, StepRecord):
        raise WireError("wrong_kind", f"a {rec.kind!r} record where a step record was expected")
    return rec


def decode_policy(frame: bytes | str) -> PolicyRecord:
    return _validate(_POLICY, frame)


def policy_from_obj(obj: Any) -> PolicyRecord:
    try:
        return _POLICY.validate_python(obj)
    except ValidationError as e:
        raise WireError(_reason(e), _first_error(e)) from None


def encode(record: StepRecord | PolicyRecord) -> bytes:
    return record.model_dump_json(by_alias=True, exclude_none=True).encode()


def to_obj(record: StepRecord | PolicyRecord) -> dict[str, Any]:
    return record.model_dump(mode="json", by_alias=True, exclude_none=True)


def encode_step_fields(
    *,
    server: str,
    rank: int,
    iter: int,
    ts: float,
    batch_size: int,
    steps: int,
    topk: int,
    draft_tokens: int,
    accepted: Optional[list[int]],
    step_ms: float,
    ctx_tokens: Optional[int] = None,
    off_path: Optional[str] = None,
) -> bytes:
    """Hot-path encoder for the engine side: no model object, no validation (the daemon
    validates every frame it takes). Produces exactly what `encode(StepRecord(...))` does."""
    return StepEncoder(server, rank).encode(iter=iter, ts=ts, batch_size=batch_size, config=(steps, topk, draft_tokens),
                                            accepted=accepted, step_ms=step_ms, ctx_tokens=ctx_tokens,
                                            off_path=off_path)


class StepEncoder:
    """encode_step_fields for one (server, rank), with what repeats cached: the frame's prefix and each
    configuration's fragment (the engine encodes one frame per decode step on the scheduler thread)."""

    def __init__(self, server: str, rank: int):
        self._prefix = ('{"kind":"step","schema":1,"server":' + json.dumps(server) + ',"rank":' + str(int(rank))
                        + ',"iter":').encode()
        self._config: dict[tuple[int, int, int], bytes] = {}

    def encode(self, *, iter: int, ts: float, batch_size: int, config: tuple[int, int, int],
               accepted: Optional[list[int]], step_ms: float, ctx_tokens: Optional[int] = None,
               off_path: Optional[str] = None) -> bytes:
        frag = self._config.get(config)
        if frag is None:
            frag = (',"config":{"steps":%d,"topk":%d,"draft_tokens":%d}' % tuple(int(v) for v in config)).encode()
            self._config[config] = frag
        ms = float(step_ms)
        tail = b"}"
        if off_path is not None:  # the wire's field order: ctx_tokens, off_path
            tail = b',"off_path":' + json.dumps(off_path).encode() + tail
        if ctx_tokens is not None:
            tail = b',"ctx_tokens":%d' % ctx_tokens + tail
        return b"".join((  # %d of the caller's ints: the engine hands Python ints (the daemon validates every frame)
            self._prefix, b"%d" % iter, b',"ts":', repr(float(ts)).encode(), b',"batch_size":%d' % batch_size,
            frag, b"" if accepted is None else b',"accepted":[' + _int_list(accepted) + b"]",
            b',"step_ms":', (repr(ms) if math.isfinite(ms) else "null").encode(), tail,
        ))


_DIGIT = bytes(range(48, 58)) + bytes(246)  # byte value v < 10 -> ASCII digit
_BELOW_10 = bytes(range(10))
_INT_BYTES = [str(i).encode() for i in range(256)]


def _int_list(values: list[int]) -> bytes:
    """`3,1,0,2` for accepted-draft counts: C-speed when all are < 10 (the common case; a per-element Python loop
    costs ~0.3 us a request, too much at batch 256 on the scheduler thread)."""
    try:
        b = bytes(values)
    except (ValueError, TypeError):  # outside 0..255: the general path
        return ",".join(str(int(v)) for v in values).encode()
    if b.translate(None, _BELOW_10):
        return b",".join([_INT_BYTES[v] for v in b])
    out = bytearray(b"," * (2 * len(b) - 1))
    out[::2] = b.translate(_DIGIT)
    return bytes(out)
