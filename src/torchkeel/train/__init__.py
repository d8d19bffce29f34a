"""Training: the step, the Trainer, and the components both are made of."""
