"""Keys and certificates of a secure deployment, made with the `cryptography` package (a dependency of flwr).

Who makes what (README "Secure deployment"):
- the SuperLink's operator: a CA (``ca.crt``/``ca.key``) and the SuperLink's TLS certificate signed by it
  (``server.crt``/``server.key``, valid for the SuperLink's host names and addresses). ``ca.crt`` goes to
  every node owner and to whoever runs ``flwr run``; the keys never leave the operator's machine.
- each table owner: a SuperNode key pair (P-384, OpenSSH format, as Flower reads them): ``node.key`` stays on
  the owner's machine, ``node.pub`` goes to the operator, who registers it (``flwr supernode register``).
  A node whose key is not registered is refused by the SuperLink (``--enable-supernode-auth``).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

VALID_DAYS = 365


@dataclass(frozen=True)
class ServerTLS:
    """The files a TLS SuperLink is started with (and ``ca`` for its clients)."""

    ca: Path
    cert: Path
    key: Path


def _write_private(path: Path, data: bytes) -> Path:
    """Write a private key readable by its owner only (created 0600, never briefly world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tpflower"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def make_server_tls(directory: str | Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> ServerTLS:
    """A fresh CA and a SuperLink certificate signed by it for ``hosts`` (IP addresses or DNS names)."""
    out = Path(directory)
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = _name("tpflower deployment CA")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA384())
    )
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    out.mkdir(parents=True, exist_ok=True)
    _write_private(out / "ca.key", _pem_key(ca_key))
    (out / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(out / "server.key", _pem_key(server_key))
    (out / "server.crt").write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    return ServerTLS(out / "ca.crt", out / "server.crt", out / "server.key")


def make_node_keys(private_path: str | Path) -> tuple[Path, Path]:
    """A SuperNode's authentication key pair (EC P-384, OpenSSH format): ``private_path`` (0600) and
    ``private_path.pub`` (what the SuperLink's operator registers). Returns (private, public)."""
    key = ec.generate_private_key(ec.SECP384R1())
    private = _write_private(
        Path(private_path),
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
    )
    public = private.with_name(private.name + ".pub")
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    )
    return private, public
