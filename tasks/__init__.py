"""Prefect tasks of the improve loop and the storage, tracking and Dask jobs they use.

Importing this package imports nothing: Dask worker processes load `gymflow.tasks.cluster.jobs` without Prefect.
"""
