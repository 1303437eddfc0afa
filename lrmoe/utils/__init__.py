"""Small helpers shared by every package: output paths, device clocks, profiler phase names."""
