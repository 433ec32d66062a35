"""A throwaway CA and certificates for mTLS tests (made with `cryptography`)."""
from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclasses.dataclass(frozen=True)
class Pem:
    cert: str   # file paths
    key: str
    ca: str


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def make_ca(directory: str, name: str = "jaxpd-test-ca"):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    path = _write(os.path.join(directory, f"{name}.pem"), cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, path


def issue(directory: str, ca, name: str) -> Pem:
    """A certificate for `name`, valid for localhost / 127.0.0.1, signed by `ca`
    (from `make_ca`); usable as a server and as a client certificate."""
    ca_key, ca_cert, ca_path = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                       x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(san, critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path = _write(os.path.join(directory, f"{name}.crt"),
                       cert.public_bytes(serialization.Encoding.PEM))
    key_path = _write(os.path.join(directory, f"{name}.key"), key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return Pem(cert_path, key_path, ca_path)
