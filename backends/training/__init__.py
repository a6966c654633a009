"""Training engines (FSDP2, megatron-core), optimizers, the reference and reward-model roles."""
