"""The setup-time proof that a converted block computes what the original did."""
