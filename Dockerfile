# gymflow's image for Kubernetes (docs/cluster.md, "Kubernetes"): the README's install, `make setup`
# with every workload extra (a .venv with gymflow, its envs, MLflow's UI and the ONNX export), whose
# bin/ comes first on PATH: the DaskCluster's pods run `dask scheduler` / `dask worker`, the work
# pool's Jobs `prefect flow-run execute`.
FROM python:3.11-slim
# make for `make setup`; git for MLflow's source tags; EGL and Mesa for MuJoCo films off-screen
RUN apt-get update \
    && apt-get install -y --no-install-recommends make git libegl1 libegl-mesa0 libgl1-mesa-dri \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/gymflow
COPY . .
RUN make setup EXTRAS=all
ENV PATH=/opt/gymflow/.venv/bin:$PATH
