"""Prefect flows (the improve loop) and the command line."""
