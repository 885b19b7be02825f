"""What may leave the process: credentials masked wherever a preset, its overrides or a URI are
logged, stored or sent (MLflow params, stored presets, Prefect events, flow-run parameters, log
lines). A credential is a value under a key naming one (`secret`, `key`, `token`, `password`,
`credential`), at any depth of a mapping, the password of a URI (`http://user:PASSWORD@host`), or
the value a free-text field (a SLURM prologue, a directive) assigns to such a name
(`export AWS_SECRET_ACCESS_KEY=...`, `--password=...`, `--token ...`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MASK = "***"
_SECRET_WORDS = ("secret", "key", "token", "password", "credential")
# scheme://user:password@host...; the password is everything up to the last @ before the host
_URI_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/@:\s]*:)(?P<password>[^/\s]*)(?P<at>@)")
_WORDS = "|".join(_SECRET_WORDS)
# NAME=VALUE or --NAME VALUE in free text, NAME holding a secret word: the value (quoted or up to
# the next blank or ;) is the credential
_ASSIGNED_SECRET = re.compile(
    rf"(?P<head>(?:^|(?<=[\s;'\"(]))(?:(?:[A-Za-z_][\w.-]*)?(?:{_WORDS})[\w.-]*=|--?[\w-]*(?:{_WORDS})[\w-]*\s+))"
    r"(?P<value>'[^']*'|\"[^\"]*\"|[^\s;'\"]+)", re.IGNORECASE)


def is_secret(field: str) -> bool:
    """A field (or dotted key) whose value is a credential, never to be logged; not one that names
    where a credential is kept (`distribution.tls.key_file`: a path)."""
    name = field.rpartition(".")[2].lower()
    return any(word in name for word in _SECRET_WORDS) and not name.endswith(("_file", "_path"))


def redacted(data: Any) -> Any:
    """`data` with every credential masked: values under secret keys at any depth (a mapping's
    whole value too), and URI passwords in any string. Dotted keys ({"storage.options.key": ...})
    count by their last part, so overrides are masked as nested presets are."""
    if isinstance(data, Mapping):
        return {key: MASK if is_secret(str(key)) and data[key] not in (None, "", {}) else redacted(data[key])
                for key in data}
    if isinstance(data, list | tuple):
        return [redacted(item) for item in data]
    if isinstance(data, str):
        return redacted_text(data)
    return data


def redacted_text(text: str) -> str:
    """Free text (a shell line, a URI) with its credentials masked: a URI's password and the value
    assigned to a name holding a secret word (`export AWS_SECRET_ACCESS_KEY=***`, `--password ***`)."""
    return _ASSIGNED_SECRET.sub(lambda match: f"{match['head']}{MASK}", redacted_uri(text))


def redacted_uri(text: str) -> str:
    """A URI's password masked: `postgresql://alice:***@db/mlflow`."""
    return _URI_PASSWORD.sub(lambda match: f"{match['head']}{MASK}{match['at']}", text)


def without_password(text: str) -> str:
    """A URI's password left out, its user kept: a link to open or a URI to hand on, the password
    coming from where the reader keeps it (`http://alice@mlflow:5000`)."""
    return _URI_PASSWORD.sub(lambda match: f"{match['head'][:-1]}{match['at']}", text)


def without_credentials(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Overrides to hand on to another run (an event's payload that a deployment trigger passes as
    its parameters): credentials left out rather than masked, so the run that receives them reads its
    own (a Secret block, its worker's environment) instead of trying `***`."""
    kept: dict[str, Any] = {}
    for key, value in overrides.items():
        if is_secret(str(key)):
            continue
        if isinstance(value, Mapping):
            value = without_credentials(value)
        elif isinstance(value, str):
            value = without_password(value)
        kept[key] = value
    return kept


def credentials_given_back(stored: Any, given: Any) -> Any:
    """`stored` (a preset as stored: redacted) with each masked credential given back from `given`
    (the caller's preset, as data) where `given` holds that same value unmasked: a population's or a
    sweep's own base preset resuming its runs. A credential `given` lacks stays masked."""
    if isinstance(stored, Mapping):
        given = given if isinstance(given, Mapping) else {}
        return {key: given[key] if _masked_secret(key, value, given.get(key))
                else credentials_given_back(value, given.get(key)) for key, value in stored.items()}
    if isinstance(stored, list):
        given = given if isinstance(given, list) and len(given) == len(stored) else [None] * len(stored)
        return [credentials_given_back(value, mate) for value, mate in zip(stored, given)]
    if isinstance(stored, str) and MASK in stored and isinstance(given, str) and redacted_text(given) == stored:
        return given
    return stored


def _masked_secret(key: Any, value: Any, given: Any) -> bool:
    return is_secret(str(key)) and value == MASK and given not in (None, "", {}, MASK)


def masked_password(uri: str) -> bool:
    """Whether `uri`'s password is the mask (a stored preset's URI, its password not stored)."""
    return any(match["password"] == MASK for match in _URI_PASSWORD.finditer(uri))


def with_password(uri: str, password: str) -> str:
    """`uri` with `password` in place of its masked one."""
    return _URI_PASSWORD.sub(lambda match: f"{match['head']}{password}{match['at']}"
                             if match["password"] == MASK else match[0], uri)
