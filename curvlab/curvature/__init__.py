"""Curvature from the engine: the Taylor split and NDS, parameter groupings, spectral estimators."""
