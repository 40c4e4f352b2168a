"""specctl.policies."""
