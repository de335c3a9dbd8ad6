"""Training on the same TP stack the engine serves: the loss, the step, the optimizer (built up in this package)."""
