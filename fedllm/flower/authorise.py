"""Runs authorised by the SuperLink's operator: ``fedllm flower run`` signs the run config, fedllm's ServerApp
refuses any run whose config it cannot verify.

``fedllm flower certs DIR`` writes the operator's Ed25519 key pair, ``DIR/operator.key`` (mode 0600: it stays on
the operator's machine) and ``DIR/operator.pub`` (``fedllm flower superlink --certificates DIR`` gives it to its
ServerApp runner). ``fedllm flower run`` adds to the run config the SHA-256 of the recipe file's bytes, the time
and a random nonce, and signs every key of the config (:data:`SIGNED`); the ServerApp verifies the signature
before it reads any file, refuses a config older than :data:`MAX_AGE_S` or whose nonce it has seen (a replayed
config), and then parses the recipe from the very bytes whose hash was signed. Whoever reaches the Control API
without the private key can therefore start nothing: not another recipe, not other overrides, not another
``output_dir``, not a file that is no recipe (its content is never read, so no error can show it).
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import secrets
import time
from pathlib import Path
from typing import Any

from fedllm.common.errors import InputError

SIGNED = ("recipe", "recipe-sha256", "overrides", "resume", "overwrite", "timeout", "probe-mb", "wait-nodes", "issued",
          "nonce")
"""The run-config keys the signature covers (``signature`` itself aside)."""
MAX_AGE_S = 600.0
"""How long a signed run config may be submitted after it was signed (and how far the clocks may differ)."""
PRIVATE, PUBLIC = "operator.key", "operator.pub"


class RunRefused(InputError):
    """A run config that is not the operator's: unsigned, altered, expired or replayed."""


def write_operator_key(directory: Path) -> dict[str, Path]:
    """``operator.key`` (Ed25519, PKCS#8 PEM, mode 0600 from creation) and ``operator.pub`` in ``directory``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    directory.mkdir(parents=True, exist_ok=True)
    private, public = directory / PRIVATE, directory / PUBLIC
    key = Ed25519PrivateKey.generate()
    private.touch(mode=0o600)
    private.chmod(0o600)
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return {"operator_key": private, "operator_pub": public}


def _load(path: Path, private: bool) -> Any:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    what = "private" if private else "public"
    try:
        data = Path(path).read_bytes()
        key = (serialization.load_pem_private_key(data, password=None) if private
               else serialization.load_pem_public_key(data))
    except (OSError, ValueError, TypeError) as e:
        raise InputError(f"{path}: not the operator's {what} key ({type(e).__name__}); fedllm flower certs DIR "
                         f"writes it as DIR/{PRIVATE if private else PUBLIC}") from None
    if not isinstance(key, Ed25519PrivateKey if private else Ed25519PublicKey):
        raise InputError(f"{path}: a {type(key).__name__}; expected the operator's Ed25519 {what} key "
                         "(fedllm flower certs)")
    return key


def _message(config: dict[str, Any]) -> bytes:
    """The signed bytes: the :data:`SIGNED` entries of ``config`` as canonical JSON."""
    return json.dumps({k: config.get(k) for k in SIGNED}, sort_keys=True, separators=(",", ":")).encode()


def sign(config: dict[str, Any], recipe_bytes: bytes, key_path: Path) -> dict[str, Any]:
    """``config`` with the recipe's hash, the time, a nonce and the operator's ``signature`` added."""
    key = _load(key_path, private=True)
    signed = {**config, "recipe-sha256": hashlib.sha256(recipe_bytes).hexdigest(), "issued": int(time.time()),
              "nonce": secrets.token_hex(16)}
    signed["signature"] = base64.b64encode(key.sign(_message(signed))).decode()
    return signed


def verify(config: dict[str, Any], public_key: Path, now: float | None = None) -> None:
    """Refuse (:class:`RunRefused`) a config not signed with ``public_key``'s private key, or signed too long ago."""
    from cryptography.exceptions import InvalidSignature

    key = _load(public_key, private=False)
    try:
        signature = base64.b64decode(str(config.get("signature", "")), validate=True)
        key.verify(signature, _message(config))
    except (InvalidSignature, ValueError):
        raise RunRefused("run refused: its run config is not signed with this SuperLink operator's key (submit it "
                         "with fedllm flower run --operator-key DIR/operator.key, the key from fedllm flower certs "
                         "DIR)") from None
    age = (time.time() if now is None else now) - float(config["issued"])
    if abs(age) > MAX_AGE_S:
        raise RunRefused(f"run refused: its run config was signed {age:.0f} s ago; a signed config is valid for "
                         f"{MAX_AGE_S:.0f} s (submit it again; check the clocks of both machines)")


def claim_nonce(config: dict[str, Any], used: Path) -> None:
    """Record the config's nonce in ``used`` (one per line, locked); refuse a nonce recorded before (a replay)."""
    nonce = str(config["nonce"])
    used.parent.mkdir(parents=True, exist_ok=True)
    with open(used, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        if nonce in f.read().split():
            raise RunRefused("run refused: this signed run config was submitted before (a replay); fedllm flower "
                             "run signs a new one every time")
        f.write(nonce + "\n")


def signed_recipe(config: dict[str, Any]) -> bytes:
    """The recipe file's bytes, refused unless their SHA-256 is the signed one (its content is never shown)."""
    path = Path(str(config["recipe"])).expanduser()
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"recipe {path}: cannot be read where the SuperLink runs ({e.strerror})") from None
    if hashlib.sha256(data).hexdigest() != config["recipe-sha256"]:
        raise RunRefused(f"run refused: recipe {path} on the SuperLink's machine is not the file that was signed "
                         "(changed since, or another file at that path)")
    return data
