"""Prefect flows (the improve loop, champion/challenger retraining) and the command line."""
