"""Option parsing shared by every `specctl` command: one syntax for configurations everywhere
(`off`, `s3`, `s2k4n16`, comma lists) and the one-line error for what the commands raise."""

from __future__ import annotations

import logging
import re
from typing import Any, Optional

import click

from . import transport, wire

ConfigKey = tuple[int, int, int]  # (steps, topk, draft_tokens)

CONFIG_HELP = "off, sN (a chain of N steps) or sNkKnD (a tree: N steps, topk K, D draft tokens)"
CONFIGS_HELP = ("comma-separated, e.g. 'off,s1,s3' or 'off,s1,s2k4n16' (spaces or ';' also separate; "
                "the older 'steps,topk,draft_tokens' triples still work, one per ';'/space-separated item)")


def parse_configs(text: str) -> tuple[ConfigKey, ...]:
    """'off,s1,s3', 'off s1 s3', 'off;s1;s3', 's2k4n16', or triples '0,1,1 3,1,4' / '3,1,4': the
    configuration keys in the order given, each once."""
    items: list[str] = []
    for tok in re.split(r"[;\s]+", text.strip()):
        parts = [p for p in tok.split(",")]
        if len(parts) == 3 and all(p.strip().isdigit() for p in parts):
            items.append(tok)  # one configuration written as steps,topk,draft_tokens
        else:
            items += [p for p in parts if p.strip()]
    if not items:
        raise ValueError(f"no configuration in {text!r}: expected e.g. 'off,s1,s3'")
    keys: list[ConfigKey] = []
    for item in items:
        key = wire.parse_config(item).key
        if key not in keys:
            keys.append(key)
    return tuple(keys)


def config_callback(ctx: click.Context, param: click.Parameter, value: Optional[str]):
    if value is None:
        return None
    try:
        return wire.parse_config(value).key
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def configs_callback(ctx: click.Context, param: click.Parameter, value: Optional[str]):
    if not value:
        return None
    try:
        return parse_configs(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def oserror_line(e: OSError) -> str:
    """'PATH: Not a directory' rather than '[Errno 20] Not a directory: ...'."""
    what = e.strerror or str(e)
    where = e.filename if e.filename is not None else None
    if e.filename2 is not None:
        where = f"{e.filename} -> {e.filename2}"
    return f"{where}: {what}" if where is not None else what


class Commands(click.Group):
    """A group whose commands end in one line naming the problem, not a traceback: click's own
    usage errors as before, an OSError as 'PATH: reason', a transport or wire error as its message,
    anything else as 'Type: message' (with --log-level DEBUG: the traceback, for a bug report)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except OSError as e:
            if _debug():
                raise
            raise click.ClickException(oserror_line(e)) from None
        except transport.TransportError as e:
            if _debug():
                raise
            raise click.ClickException(str(e)) from None
        except Exception as e:  # noqa: BLE001 - the edge: one line for the operator
            if _debug():
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise click.ClickException(f"{type(e).__name__}: {first} (--log-level DEBUG shows where)") from None


def _debug() -> bool:
    return logging.getLogger().isEnabledFor(logging.DEBUG)
