"""What may leave the process: credentials masked wherever a preset, its overrides or a URI are
logged, stored or sent (MLflow params, stored presets, Prefect events, flow-run parameters, log
lines). A credential is a value under a key naming one (a word of it `secret`, `key`, `token`,
`password`, `passwd`, `credential`, `auth`, ..., or a connection string: `is_secret`), at any depth of a
mapping, the password of a URI (`http://user:PASSWORD@host`, `mysql://u:pa/ss@db`), or the value a
free-text field (a SLURM prologue, a directive, a URI's query) assigns to such a name
(`export AWS_SECRET_ACCESS_KEY=...`, `--password=...`, `--token ...`, `?token=...&...`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MASK = "***"
# A name holds a credential where one of its words (split at _ . - and lowercase-to-uppercase) is
# one of these, or ends in one of the compounds (PGPASSWORD, clientSecret, apikey, authtoken), or
# it names a connection string; not where a word merely contains "key" (keyboard_layout, monkey)
_SECRET_PARTS = frozenset({"secret", "secrets", "key", "token", "tokens", "password", "passwords", "passwd", "pwd",
                           "credential", "credentials", "auth", "authorization", "passphrase", "sas", "cookie"})
_SECRET_ENDINGS = ("secret", "token", "password", "passwd", "credential", "credentials", "apikey", "accesskey",
                   "privatekey", "secretkey", "sessionkey", "signingkey", "passphrase")
_CONNECTION_STRINGS = ("connection_string", "connectionstring", "conn_str", "connstr")
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+")
# scheme://user:password@host...; the password is everything up to the last @ before the host
_URI_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/@:\s]*:)(?P<password>\S*?)(?P<at>@)"
                           r"(?=[^\s@/?#]*(?:[/?#\s'\";]|$))")
# NAME=VALUE (also --NAME=VALUE, a query's &NAME=VALUE) and --NAME VALUE in free text; the value (quoted,
# or up to the next blank, ; or &) is masked where NAME holds a credential (`is_secret`)
_BEGINS = r"(?:^|(?<=[\s;'\"(?&]))"
_VALUE = r"(?P<value>'[^']*'|\"[^\"]*\"|[^\s;'\"&]+)"
_ASSIGNED = re.compile(rf"(?P<head>{_BEGINS}-{{0,2}}(?P<name>[A-Za-z_][\w.-]*)=){_VALUE}")
_OPTION = re.compile(rf"(?P<head>{_BEGINS}--?(?P<name>[A-Za-z_][\w-]*)\s+)(?!-){_VALUE}")


def is_secret(field: str) -> bool:
    """A field (or dotted key, or an environment variable's name) whose value is a credential, never
    to be logged; not one that names where a credential is kept (`distribution.tls.key_file`: a path)."""
    name = field.rpartition(".")[2]
    lowered = name.lower()
    if lowered.endswith(("_file", "_path", "-file", "-path")):
        return False
    if any(compound in lowered.replace("-", "_") for compound in _CONNECTION_STRINGS):
        return True
    words = [word.lower() for word in _WORD.findall(name)]
    return any(word in _SECRET_PARTS or word.endswith(_SECRET_ENDINGS) for word in words)


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
    assigned to a name holding one (`export AWS_SECRET_ACCESS_KEY=***`, `--password=***`, `--password
    ***`, `?X-Amz-Security-Token=***&...`)."""
    text = _ASSIGNED.sub(_masked_if_secret, redacted_uri(text))
    return _OPTION.sub(_masked_if_secret, text)


def _masked_if_secret(match: re.Match) -> str:
    return f"{match['head']}{MASK}" if is_secret(match["name"]) else match[0]


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
