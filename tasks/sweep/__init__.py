"""Sweeps: configurations asked of an Optuna study that outlives the sweep's process, each run
as ordinary improve runs over several seeds, aggregated and reported."""
