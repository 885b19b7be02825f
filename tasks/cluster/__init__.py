"""The Dask cluster a run fans out over, the job hosts on its workers, the jobs they run and
the rounds that plan them."""
