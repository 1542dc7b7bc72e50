"""TLS for the tests: a self-signed certificate for 127.0.0.1 and localhost (made with the ``openssl`` CLI), and a
``redis-server`` that speaks only TLS and wants a password."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from flying.procs import free_port, spawn, stop

PASSWORD = "s3cret-pw"


def self_signed(folder: Path) -> tuple[Path, Path]:
    """(certificate, key), PEM; the certificate is its own CA (give it as the trusted one)."""
    exe = shutil.which("openssl")
    if exe is None:
        pytest.skip("the openssl command is needed to make a certificate")
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [exe, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@contextlib.contextmanager
def tls_redis(folder: Path) -> Iterator[str]:
    """A redis-server on a free port that accepts only TLS connections with ``PASSWORD``; yields its
    ``rediss://`` URL (the CA given in the query, as redis-py reads it)."""
    cert, key = self_signed(folder)
    port = free_port()
    exe = shutil.which("redis-server")
    assert exe is not None, "redis-server is needed (scripts/setup.sh installs it)"
    proc = spawn(
        [exe, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-cert-file", str(cert),
         "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
         "--requirepass", PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(folder)],
        folder / "redis.log",
    )  # fmt: skip
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={cert}"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    try:
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, (folder / "redis.log").read_text()
                assert time.monotonic() < deadline, "redis-server (TLS) did not start"
                time.sleep(0.05)
        yield url
    finally:
        client.close()
        stop(proc)
