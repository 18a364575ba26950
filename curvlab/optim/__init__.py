"""Optimizers: Muon, Adam's preconditioner, Lion, the LoRA optimizers, combined optimizers, the one builder."""
