"""The first module the LocalCluster's fork server imports (tasks/cluster/client.py, WORKER_PRELOAD):
it ignores SIGINT and SIGTERM from here on, and so does every worker forked from it.

The fork server is the flow's child, in its process group: a Ctrl-C in the terminal (or a Prefect
worker's SIGTERM to the group) during its seconds of preloading (torch, Gymnasium) ended it, and
each nanny waiting for a worker from it logged "Failed to start process ... EOFError". Python's
fork server ignores SIGINT only once its preloads are in, and hands each fork the handlers it had
before. Only the fork server imports this module: imported in the flow's process, Ctrl-C would
no longer stop the run."""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
