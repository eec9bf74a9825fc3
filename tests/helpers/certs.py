"""A throwaway CA and certificates for a TLS etcd on 127.0.0.1 (tests only)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption()))


def _cert(subject: str, key, issuer_name, issuer_key, ca: bool, usage=None):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(folder: Path, name: str = "ca") -> dict[str, Path]:
    """CA, server and client certificate files; call twice for an unrelated CA."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} test CA")])
    ca = _cert(f"{name} test CA", ca_key, ca_name, ca_key, ca=True)
    files = {}
    for role, usage in (("server", [ExtendedKeyUsageOID.SERVER_AUTH,
                                    ExtendedKeyUsageOID.CLIENT_AUTH]),
                        ("client", [ExtendedKeyUsageOID.CLIENT_AUTH])):
        key = _key()
        cert = _cert(role, key, ca_name, ca_key, ca=False, usage=usage)
        files[f"{role}_cert"] = folder / f"{name}-{role}.pem"
        files[f"{role}_key"] = folder / f"{name}-{role}-key.pem"
        files[f"{role}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, files[f"{role}_key"])
    files["ca"] = folder / f"{name}.pem"
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return files
