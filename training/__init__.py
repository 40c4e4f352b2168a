"""specctl.training."""
