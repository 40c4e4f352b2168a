"""Fixed-threshold policy: speculate with one configuration below batch N, decode plainly at >= N.

Both a user-selectable mode and the automatic fallback whenever no fresh policy exists.
"""

from __future__ import annotations

from .table import OFF, Config, PolicyTable, Row, chain

DEFAULT_THRESHOLD = 5  # the seed operator's hand-picked cutoff
DEFAULT_CONFIG: Config = chain(3)


def fixed_threshold(threshold: int = DEFAULT_THRESHOLD, config: Config = DEFAULT_CONFIG, *,
                    version: int = 0) -> PolicyTable:
    if threshold < 1:
        raise ValueError(f"threshold must be >= 1, got {threshold}")
    config = tuple(config)  # type: ignore[assignment]
    if threshold == 1 or config == OFF:
        rows: tuple[Row, ...] = (Row(1, None, OFF),)
    else:
        rows = (Row(1, threshold - 1, config), Row(threshold, None, OFF))
    return PolicyTable(rows=rows, version=version, source="fixed")


def static(config: Config) -> PolicyTable:
    return PolicyTable(rows=(Row(1, None, tuple(config)),), source="fixed")  # type: ignore[arg-type]
