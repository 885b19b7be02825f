"""Which runs this process has begun the work of (an MLflow run made for it, its record about to be
stored): a command that fails before then was refused and leaves nothing behind; one that fails
after keeps its log beside what the run wrote. A leaf: anything may import it."""

_BEGUN: set[str] = set()


def began(run_id: str) -> None:
    _BEGUN.add(run_id)


def has_begun(run_id: str) -> bool:
    return run_id in _BEGUN
