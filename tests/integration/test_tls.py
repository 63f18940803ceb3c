"""HTTPS through the server's certificate options, with Triton's client."""

from __future__ import annotations

import ssl
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support.onnx_models import write_identity
from tests.support.stack import Stack


def test_tls_serves_https(tmp_path: Path, start_stack: Callable[..., Stack]) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    repository = tmp_path / "repository"
    write_identity(repository, "echo", ["FP32"])
    stack = start_stack(
        repository, env={"SLUICE_SSL_CERTFILE": str(cert), "SLUICE_SSL_KEYFILE": str(key)}
    )
    https = stack.url.replace("http://", "https://")
    with httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=10) as client:
        assert client.get(f"{https}/v2/health/ready").status_code == 200
    with httpx.Client(timeout=10) as plain:
        try:
            plain.get(f"{stack.url}/v2/health/ready")
            raise AssertionError("plain HTTP was answered on the TLS port")
        except httpx.HTTPError:
            pass
    with httpclient.InferenceServerClient(
        stack.address,
        ssl=True,
        ssl_context_factory=lambda **_: ssl.create_default_context(cafile=str(cert)),
    ) as client:
        data = np.arange(6, dtype=np.float32).reshape(2, 3)
        tensor = httpclient.InferInput("IN_FP32", [2, 3], "FP32")
        tensor.set_data_from_numpy(data)
        result = client.infer("echo", [tensor])
        np.testing.assert_array_equal(result.as_numpy("OUT_FP32"), data)
    with grpcclient.InferenceServerClient(
        stack.grpc_address, ssl=True, root_certificates=str(cert)
    ) as secure:
        result = secure.infer("echo", [grpc_input(data)])
        np.testing.assert_array_equal(result.as_numpy("OUT_FP32"), data)
    with (
        grpcclient.InferenceServerClient(stack.grpc_address) as plain_grpc,
        pytest.raises(InferenceServerException),
    ):
        plain_grpc.is_server_live(client_timeout=5)


def grpc_input(data: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("IN_FP32", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    return tensor


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _signed(folder: Path, name: str, ca: tuple[Path, Path], subject: str, ext: str) -> Path:
    """``<name>.pem`` and ``<name>.key`` in ``folder``, signed by ``ca``."""
    key, request, cert = folder / f"{name}.key", folder / f"{name}.csr", folder / f"{name}.pem"
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", str(key),
        "-out", str(request),
    )  # fmt: skip
    extensions = folder / f"{name}.ext"
    extensions.write_text(ext)
    _openssl(
        "x509", "-req", "-in", str(request), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
        "-CAcreateserial", "-days", "1", "-extfile", str(extensions), "-out", str(cert),
    )  # fmt: skip
    return cert


def test_tritons_grpc_tls_flags_mutual_tls_on_grpc_and_plain_http(tmp_path: Path) -> None:
    """Triton's --grpc-use-ssl-mutual with --grpc-server-cert, --grpc-server-key and
    --grpc-root-cert: gRPC takes only clients with a certificate the root signed, while
    HTTP (no certificate of its own) stays plain, as in Triton."""
    ca_key, ca_cert = tmp_path / "ca.key", tmp_path / "ca.pem"
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
        "-keyout", str(ca_key), "-out", str(ca_cert),
    )  # fmt: skip
    ca = (ca_cert, ca_key)
    server = _signed(tmp_path, "server", ca, "/CN=127.0.0.1", "subjectAltName=IP:127.0.0.1\n")
    client = _signed(tmp_path, "client", ca, "/CN=client", "extendedKeyUsage=clientAuth\n")
    repository = tmp_path / "repository"
    write_identity(repository, "echo", ["FP32"])
    stack = Stack(
        repository,
        None,
        args=[
            "--grpc-use-ssl-mutual=true",
            f"--grpc-server-cert={server}",
            f"--grpc-server-key={tmp_path / 'server.key'}",
            f"--grpc-root-cert={ca_cert}",
        ],
    )
    stack.start()
    try:
        data = np.arange(6, dtype=np.float32).reshape(2, 3)
        with httpx.Client(timeout=10) as plain:
            assert plain.get(f"{stack.url}/v2/health/ready").status_code == 200
        with grpcclient.InferenceServerClient(
            stack.grpc_address,
            ssl=True,
            root_certificates=str(ca_cert),
            private_key=str(tmp_path / "client.key"),
            certificate_chain=str(client),
        ) as trusted:
            result = trusted.infer("echo", [grpc_input(data)])
            np.testing.assert_array_equal(result.as_numpy("OUT_FP32"), data)
        with (
            grpcclient.InferenceServerClient(
                stack.grpc_address, ssl=True, root_certificates=str(ca_cert)
            ) as anonymous,
            pytest.raises(InferenceServerException),
        ):
            anonymous.is_server_live(client_timeout=5)
    finally:
        stack.stop()
