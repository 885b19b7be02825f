"""gymflow: the reinforcement-learning improve loop (heatup -> train -> evaluate) as a Prefect
flow, rollouts on Dask, experience and checkpoints in object storage, runs in MLflow.

The repository keeps one folder per role; installed, each is a package under this namespace:

    gymflow.flows     flows/     the Prefect flows (improve, retrain) and the command line
    gymflow.tasks     tasks/     Prefect tasks and the I/O they use, grouped by role:
                                 training (the loop's state, collection, learning, evaluation),
                                 storage (objects, checkpoints, shards), cluster (Dask, job
                                 hosts, jobs), tracking (MLflow, models, plots)
    gymflow.agents    agents/    algorithms, networks, replay; never imports Prefect, Dask or MLflow
    gymflow.envs      envs/      making and checking envs, the seeded vector env, EnvPool's C++ envs behind it
    gymflow.presets   presets/   the validated preset model, built-in presets, overrides
    gymflow.testing   testing/   helpers for tests and drills: small envs, a storage fault proxy,
                                 an in-process job runner
    gymflow.errors               the errors a user sees: one line naming the field or resource
    gymflow.outage               how long a server the run depends on has gone unanswered, against its budget
    gymflow.imports              big imports without the garbage collector's scans

Importing this package imports nothing else.
"""
