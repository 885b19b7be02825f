"""The experience lake: a run's stored experience as a dataset (export)."""
