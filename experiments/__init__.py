"""Recipes (launched with torchrun) and the synthetic tasks they and the tests use."""
