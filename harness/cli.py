"""The `specctl` console script: the runtime commands (controller.cli) plus `bench` and `demo`."""

from __future__ import annotations

from ..controller import cli as runtime
from .cli_bench import bench, demo
from .cli_reliability import reliability

bench.add_command(reliability)

# a group of its own (the runtime group's class: one-line errors) with its options and callback, so
# importing the harness never changes what `python -m specctl.controller.cli` offers
main = type(runtime.main)(name="specctl", commands={**runtime.main.commands, "bench": bench, "demo": demo},
                                params=runtime.main.params, callback=runtime.main.callback, help=runtime.main.help,
                                context_settings=runtime.main.context_settings)


if __name__ == "__main__":
    main()
