"""TLS for the direct channel between hosts (issue 40): the agent's own certificate, pinned by the broker.

An agent reached over TCP makes a fresh key and a self-signed certificate when it opens its listener, and hands the
certificate to the broker through Ray (which authenticated both ends), as it hands the token. The broker trusts that
certificate alone, so no certificate authority is set up and nothing else on the network can stand in for the agent;
inside the TLS session the broker then sends the token, as on the unix socket, so nothing else can call the agent.
The key never leaves the agent's memory but for the moment ``ssl`` needs a file to load it from, in the agent's
private channel directory.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: how long an agent's certificate is valid: it is pinned, not checked against a calendar, but TLS needs a span
VALID_FOR = datetime.timedelta(days=3650)


def server_context(address: str, directory: Path) -> tuple[ssl.SSLContext, str]:
    """A TLS server context under a new key and a certificate for ``address``, and the certificate (PEM) that a
    client pins; the key is written to a file in ``directory`` (private to the agent) only while it is loaded."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"tangram agent {address}")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALID_FOR)
        .add_extension(x509.SubjectAlternativeName([_general_name(address)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256()))
    pem = certificate.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".agent-tls-", suffix=".pem") as chain:  # mode 0600
        chain.write(key_pem + pem)
        chain.flush()
        context.load_cert_chain(chain.name)
    return context, pem.decode()


def client_context(certificate: str) -> ssl.SSLContext:
    """A TLS client context that accepts the agent holding ``certificate`` (PEM) and nobody else: the certificate
    is the only one trusted, so its address need not be checked as a name."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=certificate)
    return context


def _general_name(address: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(address))
    except ValueError:
        return x509.DNSName(address)
