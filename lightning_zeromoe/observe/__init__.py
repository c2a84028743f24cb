"""What the run shows the user: expert load telemetry, the monitor, heatmaps."""
