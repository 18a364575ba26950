"""Curvature reports of checkpoints: targets, reports, paired directions, spectra."""
