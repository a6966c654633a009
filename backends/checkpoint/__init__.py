"""Sharded train-state checkpoints (DCP) and resume, HF export, orbax interop."""
