"""Training: data, objectives, optimiser, steps, checkpoints, metrics and the loop."""
