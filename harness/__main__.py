"""`python -m specctl.harness ...` is the `specctl` console script."""

from .cli import main

main()
