"""Training: the trainer loop, jitted steps, optimizers, schedules, metrics and the CLI."""
