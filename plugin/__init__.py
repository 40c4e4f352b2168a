"""specctl.plugin."""
