"""A real S3 API server on loopback for tests and benchmarks: moto's server mode in a process of
its own, on a free port."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def moto_on_loopback(env: dict[str, str] | None = None, start_timeout_s: float = 30) -> Iterator[str]:
    """A moto S3 server answering on 127.0.0.1 (`env` added to its environment); its endpoint URL.
    Ended on the way out."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)


# moto's server checks every request's signature once this many have gone unchecked (its IAM
# authentication): the four of `user_and_bucket`
SET_UP_REQUESTS = 4


def user_and_bucket(endpoint: str, bucket: str, user: str = "gymflow") -> tuple[str, str]:
    """On a fresh moto server started with INITIAL_NO_AUTH_ACTION_COUNT=SET_UP_REQUESTS: a user
    allowed everything, its access key (returned: key, secret) and `bucket`. Every later request
    must be signed with a key the server made."""
    import boto3

    admin = {"endpoint_url": endpoint, "region_name": "us-east-1",
             "aws_access_key_id": "setup", "aws_secret_access_key": "setup"}
    iam = boto3.client("iam", **admin)
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="everything", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    boto3.client("s3", **admin).create_bucket(Bucket=bucket)
    return key["AccessKeyId"], key["SecretAccessKey"]
