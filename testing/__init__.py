"""Helpers for tests and fault drills, kept apart from the product's code paths: small envs
(`gymflow.testing.envs`), a storage fault proxy (`gymflow.testing.faults`), a loopback S3 server
(`gymflow.testing.s3`) and an in-process job runner that stands in for the Dask job hosts
(`gymflow.testing.hosts`)."""
