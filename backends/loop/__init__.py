"""The layer above training and rollout: what joins a training engine to a rollout engine (the weight bridge)."""
