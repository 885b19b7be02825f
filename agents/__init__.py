"""Algorithms, networks, replay memories and collection. Never imports Prefect, s3fs or MLflow."""
