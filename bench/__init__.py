"""Benchmarks that anyone can rerun: each script measures ratios side by side in one process and
prints the command and machine its results belong with (see docs/benchmarks.md)."""
