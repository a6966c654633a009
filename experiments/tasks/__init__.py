"""Synthetic tasks: data generators and rewards, for the demo and the tests."""
