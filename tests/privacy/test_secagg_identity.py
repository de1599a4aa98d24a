"""SecAgg+ keys bound to the node identities of ``fedllm flower certs`` (``pytest -k secagg``): a client's signature
verifies with its registered node key over exactly the advertised keys and the round, and anything else — a key
substituted in transit, another round, another client's signature, an unregistered client — is refused."""

import struct

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from fedllm.flower.certs import write_node_keys
from fedllm.privacy.secagg import KeyAdvert, SecAggError, crypto, identity


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    directory = tmp_path_factory.mktemp("nodes")
    write_node_keys(directory, 3)
    return directory


def advert(cid):
    return KeyAdvert(cid, crypto.new_key_pair()[1], crypto.new_key_pair()[1])


def test_secagg_signature_covers_the_round_the_client_and_both_keys(keys):
    a, ctx = advert(1), b"round-context"
    signature = identity.sign(identity.load_signing_key(keys / "client-1.key"), ctx, a)
    peers = identity.load_peer_keys(keys)
    assert sorted(peers) == [0, 1, 2]
    # independently: ECDSA P-384 / SHA-384 over purpose ‖ context ‖ id (int64 LE) ‖ c_pk ‖ s_pk
    message = b"fedllm-secagg/advert/" + ctx + struct.pack("<q", 1) + a.encryption_key + a.masking_key
    peers[1].verify(signature, message, ec.ECDSA(hashes.SHA384()))
    identity.verify(peers, ctx, a, signature)


@pytest.mark.parametrize("forgery", ["masking key", "encryption key", "round", "signer", "unregistered"])
def test_secagg_a_substituted_or_foreign_key_is_refused(keys, forgery):
    a, ctx = advert(1), b"round-context"
    signer = identity.load_signing_key(keys / ("client-2.key" if forgery == "signer" else "client-1.key"))
    signature = identity.sign(signer, ctx, a)
    forged = {"masking key": KeyAdvert(1, a.encryption_key, crypto.new_key_pair()[1]),
              "encryption key": KeyAdvert(1, crypto.new_key_pair()[1], a.masking_key),
              "unregistered": KeyAdvert(7, a.encryption_key, a.masking_key)}.get(forgery, a)
    with pytest.raises(SecAggError, match="not signed by its registered node key|no registered node key"):
        identity.verify(identity.load_peer_keys(keys), b"another-round" if forgery == "round" else ctx, forged,
                        signature)
