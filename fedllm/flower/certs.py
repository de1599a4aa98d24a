"""``fedllm flower certs DIR --host NAME [--clients N]``: a private CA, a SuperLink certificate, node keys.

Writes ``ca.crt`` (give it to every SuperNode and to ``fedllm flower run`` as ``--root-certificates``),
``ca.key`` (keep it private), ``server.pem`` and ``server.key`` (the SuperLink's, for
``fedllm flower superlink --certificates DIR``). The server certificate names every ``--host`` (DNS names
or IP addresses) the nodes use to reach the SuperLink, and 127.0.0.1/localhost (fedllm's ServerApp runner
reaches the SuperLink's local Runtime API there). With ``--clients N``, ``nodes/client-K.key`` and
``nodes/client-K.pub`` for K < N: the SuperNode authentication key pair of client K's node (ECDSA P-384,
OpenSSH format, as Flower's ``--auth-supernode-private-key`` and ``flwr supernode register`` read them);
copy ``client-K.key`` to that node only. ``operator.key`` / ``operator.pub``: the operator's Ed25519 pair that signs
every run (:mod:`fedllm.flower.authorise`); ``operator.key`` stays with whoever runs ``fedllm flower run``. For
production, use certificates from your PKI.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from fedllm.common.errors import InputError


def _name(text: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])


def write_node_keys(directory: Path, clients: int) -> dict[str, Path]:
    """``client-K.key`` (mode 0600) and ``client-K.pub`` for K < ``clients`` in ``directory``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for k in range(clients):
        key = ec.generate_private_key(ec.SECP384R1())
        private, public = directory / f"client-{k}.key", directory / f"client-{k}.pub"
        private.touch(mode=0o600)
        private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                              serialization.NoEncryption()))
        public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                         serialization.PublicFormat.OpenSSH) + b"\n")
        files[f"node{k}_key"], files[f"node{k}_pub"] = private, public
    return files


def write_certificates(directory: Path, hosts: list[str], days: int = 365, clients: int = 0) -> dict[str, Path]:
    """Create the CA, the server certificate for ``hosts`` and ``clients`` node key pairs in ``directory``;
    refuse to overwrite."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    directory = Path(directory)
    files = {"ca": directory / "ca.crt", "ca_key": directory / "ca.key", "cert": directory / "server.pem",
             "key": directory / "server.key"}
    if clients < 0:
        raise InputError(f"--clients={clients}: expected an integer >= 0")
    existing = [str(p) for p in files.values() if p.exists()]
    existing += [str(p) for p in (directory / "operator.key", directory / "operator.pub") if p.exists()]
    existing += [str(p) for p in sorted((directory / "nodes").glob("client-*"))] if clients else []
    if existing:
        raise InputError(f"{directory}: {', '.join(existing)} already exist; choose an empty directory")
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca = (x509.CertificateBuilder().subject_name(_name("fedllm CA")).issuer_name(_name("fedllm CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    alt = []
    for host in dict.fromkeys([*hosts, "127.0.0.1", "localhost"]):
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt.append(x509.DNSName(host))
    cert = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    private = dict(encoding=pem, format=serialization.PrivateFormat.PKCS8,
                   encryption_algorithm=serialization.NoEncryption())
    files["ca"].write_bytes(ca.public_bytes(pem))
    files["cert"].write_bytes(cert.public_bytes(pem))
    for path, k in ((files["ca_key"], ca_key), (files["key"], key)):
        path.touch(mode=0o600)  # private from its creation, not after the write
        path.chmod(0o600)
        path.write_bytes(k.private_bytes(**private))
    files.update(write_node_keys(directory / "nodes", clients))
    from fedllm.flower.authorise import write_operator_key

    files.update(write_operator_key(directory))
    return files
