"""Certificates made by a test: a CA of its own and a server certificate it signed for 127.0.0.1 and localhost or
the names a test gives (PEM files in a directory), so that TLS is tested with verification on and nothing from outside."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Certs:
    ca: Path  # the CA's certificate: what verifies the server
    cert: Path  # the server's certificate
    key: Path  # the server's private key


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str, issuer: str, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def make_certs(directory: Path, names: tuple[str, ...] = ("localhost", "127.0.0.1")) -> Certs:
    """A CA and a server certificate naming `names` (DNS names, and IP addresses as IP entries)."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (
        _builder("tandem test CA", "tandem test CA", ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )  # digital_signature, key_cert_sign, crl_sign
        .sign(ca_key, hashes.SHA256())
    )
    server = (
        _builder(names[0], "tandem test CA", key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    certs = Certs(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
    certs.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    certs.cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    certs.key.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return certs


class _VerifyAs(ssl.SSLContext):
    name = ""

    def wrap_socket(self, sock, *args, server_hostname=None, **kwargs):  # noqa: ANN001, ANN002, ANN003
        return super().wrap_socket(sock, *args, server_hostname=self.name, **kwargs)


def verify_as(ca: Path, name: str) -> ssl.SSLContext:
    """What httpx's `verify` takes to reach a server at an address its certificate does not name: its
    certificate is verified against `name` (as a client that resolved `name` to that address would)."""
    context = _VerifyAs(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(ca)
    context.name = name
    return context
