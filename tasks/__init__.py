"""Prefect tasks of the improve loop and the I/O they use, grouped by role: training (the
loop), storage, cluster, tracking. Importing a package here imports nothing: Dask worker
processes load `gymflow.tasks.cluster.jobs` without Prefect."""
