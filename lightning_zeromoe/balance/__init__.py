"""Keeping experts balanced: the bias balancer and its update rule."""
