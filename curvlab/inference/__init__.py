"""General statistical inference: seed-level intervals, exact permutation and sign-flip tests, Holm's
correction, coverage and power (docs/science.md section 12). Knows nothing of runs or the paper."""
