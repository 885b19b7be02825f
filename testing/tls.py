"""Self-signed TLS material for a Dask cluster on loopback, for tests and drills: a CA, and a
certificate for 127.0.0.1 / localhost that it signed, which the scheduler, the workers and the
flow all present (Dask's TLS is mutual). docs/cluster.md shows the same with openssl.

    files = write_certificates(folder)   # files.ca_file, files.cert_file, files.key_file
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from gymflow.files import write_whole


@dataclass(frozen=True)
class TLSFiles:
    ca_file: str
    cert_file: str
    key_file: str


def write_certificates(folder: Path, name: str = "gymflow-test") -> TLSFiles:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    names = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(names, critical=False).sign(ca_key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    files = TLSFiles(str(folder / f"{name}-ca.pem"), str(folder / f"{name}.pem"), str(folder / f"{name}-key.pem"))
    Path(files.ca_file).write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    Path(files.cert_file).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    # the private key readable by its owner alone from its first byte (write_bytes: 0644 under a usual umask)
    write_whole(Path(files.key_file), key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()).decode(), 0o600)
    return files
