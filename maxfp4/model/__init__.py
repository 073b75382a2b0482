"""Models: every linear layer goes through ``maxfp4.precision.dot``."""
