"""A training run: set-up, the loop, one optimizer step, the guard, strategies, tracking and the run's outputs."""
