"""Parallelism that wraps the model's blocks without changing them: pipeline stages."""
