"""specctl.controller."""
