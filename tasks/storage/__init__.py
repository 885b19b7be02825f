"""Object storage (a local folder or S3), versioned checkpoints, experience shards and run
records, all loadable without executing code. Imports no Prefect."""
