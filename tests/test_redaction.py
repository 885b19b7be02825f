"""Credentials masked wherever a preset, overrides or a URI leave the process (presets/redaction.py);
the end-to-end search of every sink is tests/test_s3_storage.py's block test."""

from __future__ import annotations

import json

from gymflow.presets import load_preset
from gymflow.presets.load import flatten
from gymflow.presets.redaction import redacted, redacted_uri, without_credentials, without_password
from gymflow.tasks.training.run import run_tags

PLANTED = "planted-s3cr3t"


def _with_secrets_at_every_depth() -> dict:
    preset = load_preset("cartpole-ppo").model_dump(mode="json")
    preset["storage"]["options"] = {
        "key": PLANTED, "endpoint_url": "http://127.0.0.1:9000",
        "client_kwargs": {"aws_session_token": PLANTED, "region_name": "eu-west-1",
                          "proxies": [{"password": PLANTED}, f"http://bob:{PLANTED}@proxy:3128"]},
        "credentials": {"user": "alice", "nested": PLANTED},
    }
    preset["tracking"]["tracking_uri"] = f"https://alice:{PLANTED}@mlflow.example.com:5000/"
    return preset


def test_every_credential_of_a_preset_is_masked_at_any_depth_and_nothing_else_changes():
    preset = _with_secrets_at_every_depth()
    safe = redacted(preset)
    assert PLANTED not in json.dumps(safe)
    options = safe["storage"]["options"]
    assert options["key"] == options["client_kwargs"]["aws_session_token"] == options["credentials"] == "***"
    assert options["client_kwargs"]["proxies"] == [{"password": "***"}, "http://bob:***@proxy:3128"]
    assert safe["tracking"]["tracking_uri"] == "https://alice:***@mlflow.example.com:5000/"
    masked = {"storage.options", "tracking.tracking_uri"}
    assert {key: value for key, value in flatten(safe).items() if not key.startswith(tuple(masked))} == \
        {key: value for key, value in flatten(preset).items() if not key.startswith(tuple(masked))}
    assert options["endpoint_url"] == "http://127.0.0.1:9000" and options["client_kwargs"]["region_name"] == "eu-west-1"
    assert PLANTED in json.dumps(preset)  # the preset itself is left as it was


def test_overrides_as_dotted_keys_are_masked_for_logs_and_left_out_for_another_run():
    overrides = {"storage.options.client_kwargs.aws_secret_access_key": PLANTED, "storage.options.secret": PLANTED,
                 "tracking.tracking_uri": f"postgresql+psycopg2://mlflow:{PLANTED}@db:5432/mlflow",
                 "storage.options": {"token": PLANTED, "endpoint_url": "http://s3:9000"}, "agent.lr": 0.001}
    assert PLANTED not in json.dumps(redacted(overrides))
    assert PLANTED not in run_tags(overrides)["gymflow.overrides"]
    handed_on = without_credentials(overrides)
    assert handed_on == {"tracking.tracking_uri": "postgresql+psycopg2://mlflow@db:5432/mlflow",
                         "storage.options": {"endpoint_url": "http://s3:9000"}, "agent.lr": 0.001}


def test_a_uri_loses_only_its_password():
    assert redacted_uri("http://alice:p@ss:w0rd@host:5000/x?y=1") == "http://alice:***@host:5000/x?y=1"
    assert without_password("http://alice:pw@host:5000") == "http://alice@host:5000"
    for plain in ("sqlite:///mlflow.db", "http://host:5000/path", "s3://bucket/prefix", "file:///tmp/a:b@c",
                  "http://alice@host"):
        assert redacted_uri(plain) == plain == without_password(plain)
