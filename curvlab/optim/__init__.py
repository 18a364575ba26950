"""Optimizers and their next step: Muon, the LoRA optimizers, the one builder, shadow states."""
