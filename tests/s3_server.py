"""moto's S3 server as a process on loopback, for the tests of the store on object storage (and the benchmark)."""

import os
import re
import subprocess
import sys
import uuid
from contextlib import contextmanager

import requests

from tests.ports import free_port
from tests.waiting import answers, wait_until

BUCKET = "evals"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
               "AWS_ALLOW_HTTP": "true"}


@contextmanager
def running_s3_server(bucket: str = BUCKET):
    """Start `moto_server` on a free loopback port, create `bucket`, and set the AWS_* environment (for this
    process and its children) while it runs; yields the endpoint URL."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = {name: os.environ.get(name) for name in (*CREDENTIALS, "AWS_ENDPOINT_URL")}
    try:
        wait_until(answers(endpoint, status=None), 60, f"moto's S3 server on {endpoint}", server)
        os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
        requests.put(f"{endpoint}/{bucket}", timeout=10).raise_for_status()  # CreateBucket (moto takes it unsigned)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def fresh_prefix(name: str, bucket: str = BUCKET) -> str:
    """A store URL under a prefix no other test uses."""
    return f"s3://{bucket}/{re.sub(r'[^a-zA-Z0-9_-]+', '-', name)[:60]}-{uuid.uuid4().hex[:8]}"
