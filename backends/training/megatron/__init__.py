"""Megatron-core backend: tensor / pipeline / data parallel actor, critic and reference for HF Llama
and Qwen2 checkpoints (``engine``), on CPU with gloo and on GPUs with megatron's own schedules."""
