"""What the run shows the user: expert load telemetry, the monitor, heatmaps, and what it
communicates (:mod:`lightning_zeromoe.observe.comm_ledger`)."""
