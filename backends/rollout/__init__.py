"""Rollout engines (the native torch engine, vLLM) behind one API (`backends.rollout.api`)."""
