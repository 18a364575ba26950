"""Training runs: checkpoints, the one training loop, the curvature monitor, matching runs by loss."""
