"""The process's runtime: host identity, signals, fork/exit lifecycle, multi-rank coordination."""
