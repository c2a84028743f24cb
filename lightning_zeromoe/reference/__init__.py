"""The small reference MoE model used by the demo, tests and the troubleshooter."""
