"""The packages of gymflow's extras (pyproject.toml) a feature needs: looked up before any work, so
that a feature whose extra is not installed says so in one line naming the extra."""

from __future__ import annotations

import importlib.util

# each feature's modules, by the package pip installs them from
STACK = {"moto": "moto[server]", "psycopg": "psycopg[binary]", "flask_wtf": "mlflow[auth]"}
KUBE = {"kubernetes_validate": "kubernetes-validate", "dask_kubernetes": "dask-kubernetes"}


def extra_missing(feature: str, extra: str, modules: dict[str, str]) -> str | None:
    """What `feature` says where a module of `modules` (module -> package) is not installed: the
    packages and the extra that has them; None where all are."""
    missing = [package for module, package in modules.items() if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    return f"{feature} needs {', '.join(missing)}, not installed: gymflow's {extra} extra has them " \
           f"(pip install 'gymflow[{extra}]')"
