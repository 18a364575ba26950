"""Studies over many checkpoints and runs: comparisons, tracks, statistics, results, the paper."""
