"""Utilities every layer may use: atomic writes, progress bars, the distributed context."""
