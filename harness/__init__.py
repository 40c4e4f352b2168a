"""specctl.harness: benchmarks, drills and the demo, above the runtime packages (nothing runtime imports it)."""
