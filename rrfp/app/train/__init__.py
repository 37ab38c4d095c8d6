"""The training loop on one rank (``stage_main``) and what it needs: checkpoints, the start-up
checks and summary, optimizers and the learning-rate schedule, evaluation and metrics."""
