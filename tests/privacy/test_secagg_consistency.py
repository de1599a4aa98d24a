"""SecAgg+ against a server that lies about who dropped out (``pytest -k secagg``): the consistency check of
Bonawitz et al., CCS 2017, §4 (survivors sign the survivor list ``U3``; a client reveals shares only for the list it
signed, once a quorum of valid signatures over that very list is shown to it).

The attack it stops: tell some of client 7's neighbours that 7 survived (they reveal shares of its self-mask seed
``b_7``) and the others that it dropped (they reveal shares of its masking key ``s_7``), rebuild both and strip every
mask off 7's masked input. The test first checks, with the shares the neighbours hold, that both secrets do unmask
7's input exactly (the attack is real), then that the checked protocol never lets the server get both.
"""

import numpy as np
import pytest

from fedllm.privacy.secagg import SecAggError, SecAggParams, UnmaskRequest, crypto, identity, masks
from fedllm.privacy.secagg.client import mask_sign, pair_info
from fedllm.privacy.secagg.messages import SurvivorSignature
from tests.privacy.test_secagg_protocol import IDS, P, staged, words

VICTIM = 7
LIVE = UnmaskRequest(tuple(IDS), ())  # "7 survived"
GONE = UnmaskRequest(tuple(c for c in IDS if c != VICTIM), (VICTIM,))  # "7 dropped"


def masked_round(params=P):
    """Clients, server and masked inputs after stage 3, every client alive."""
    clients, server, routed = staged(params)
    inputs = words(11)
    received = [clients[c].mask(inputs[c], routed[c]) for c in IDS]
    return clients, server, inputs, received


def unmask_victim(clients, masked, seed_shares, key_shares, params=P):
    """The lying server's last step: 7's input from its masked vector, ``b_7`` and ``s_7`` rebuilt from shares."""
    b = crypto.combine(dict(sorted(seed_shares.items())[: params.threshold]))
    s_sk = crypto.private_key(crypto.combine(dict(sorted(key_shares.items())[: params.threshold])))
    y = masked[VICTIM] - masks.expand(b, masked[VICTIM].size, np.uint32)
    for v in clients[VICTIM].masked_with:
        pair = masks.expand(crypto.agree(s_sk, clients[v].mask_pk, pair_info(b"mask", b"ctx", VICTIM, v)), y.size,
                            np.uint32)
        y = y - pair if mask_sign(VICTIM, v) > 0 else y + pair
    return y


def test_secagg_the_dropout_lie_unmasks_a_client_without_the_check():
    """The oracle of the attack: with the shares 7's neighbours hold (what unchecked clients would reveal when told
    different stories), the server recovers 7's input exactly."""
    clients, _, inputs, received = masked_round()
    masked = {m.client_id: m.vector for m in received}
    holders = clients[VICTIM].neighbours
    seed_shares = {clients[v].held[VICTIM][0]: clients[v].held[VICTIM][1] for v in holders}
    key_shares = {clients[v].held[VICTIM][0]: clients[v].held[VICTIM][2] for v in holders}
    assert np.array_equal(unmask_victim(clients, masked, seed_shares, key_shares), inputs[VICTIM])


@pytest.mark.parametrize("told_live", [(0, 1, 2, 7), (0, 1, 2, 3, 7), (0, 1, 2, 3, 4, 7)])
def test_secagg_a_server_telling_clients_different_survivor_lists_gets_no_quorum(told_live):
    """Clients in ``told_live`` are sent "7 survived", the others "7 dropped"; every client signs what it was sent and
    the server forwards all signatures to all. At most one story gathers the quorum (6 of 8), so no client reveals a
    share for the other story: the server never holds shares of both b_7 and s_7, and a refusing client says why."""
    clients, server, _, received = masked_round()
    story = {c: LIVE if c in told_live else GONE for c in IDS}
    signatures = {c: clients[c].check(story[c]) for c in IDS}
    assert P.quorum(len(IDS)) == 6
    reveals, refusals = [], {}
    for c in IDS:
        try:
            reveals += clients[c].unmask(story[c], signatures)
        except SecAggError as e:
            refusals[c] = str(e)
    winners = {c for c in IDS if sum(story[v] == story[c] for v in IDS) >= 6}
    assert set(refusals) == set(IDS) - winners  # only a story signed by a quorum is answered
    for c, why in refusals.items():
        assert f"client {c}: {sum(story[v] == story[c] for v in IDS)} valid signatures over the survivor list" in why
        assert "the server sent other clients another list" in why and "refused to reveal any share" in why
        assert "its signature is not over this survivor list and round" in why  # the other story's signatures
    kinds = {}
    for r in reveals:
        kinds.setdefault(r.owner, set()).add(r.kind)
    assert all(len(k) == 1 for k in kinds.values())  # never both secrets of one client
    assert "key" not in kinds.get(VICTIM, set())
    # the server's own step (run by an honest server) refuses the mixed signatures too, naming the other list's
    assert server.collect_masked(received) == LIVE
    forwarded = [SurvivorSignature(c, s) for c, s in signatures.items()]
    if len(told_live) < 6:
        with pytest.raises(SecAggError, match=r"survivors signed the survivor list, fewer than the consistency quorum "
                                              r"6.*client \d: its signature is not over this survivor list"):
            server.collect_signatures(forwarded)
    else:
        assert sorted(server.collect_signatures(forwarded)) == sorted(told_live)


def test_secagg_a_client_never_signs_or_answers_two_different_survivor_lists():
    clients, _, _, _ = masked_round()
    signatures = {c: clients[c].check(LIVE) for c in IDS}
    first = clients[0].unmask(LIVE, signatures)
    assert clients[0].unmask(LIVE, signatures) == first  # the same list again: the same answer
    assert {r.kind for r in first} == {"seed"} and sorted(r.owner for r in first) == clients[0].neighbours
    with pytest.raises(SecAggError, match=r"asked to sign a second survivor list .* refused"):
        clients[0].check(GONE)
    with pytest.raises(SecAggError, match="not the list it signed"):
        clients[0].unmask(GONE, signatures)
    fresh = masked_round()[0]
    with pytest.raises(SecAggError, match="not the list it signed"):  # nothing revealed before signing
        fresh[1].unmask(LIVE, signatures)


def test_secagg_an_honest_dropout_reveals_key_shares_for_the_complement_only():
    """7 really dropped: every survivor that shares with 7 reveals its share of s_7, of b_v for every other
    neighbour, and the server's sum is exact."""
    clients, server, routed = staged()
    inputs = words(12)
    request = server.collect_masked([clients[c].mask(inputs[c], routed[c]) for c in IDS if c != VICTIM])
    assert request == GONE
    signatures = server.collect_signatures([SurvivorSignature(c, clients[c].check(request)) for c in GONE.survivors])
    reveals = [r for c in signatures for r in clients[c].unmask(request, signatures)]
    assert {(r.owner, r.kind) for r in reveals if r.owner == VICTIM} == {(VICTIM, "key")}
    assert all(r.kind == "seed" for r in reveals if r.owner != VICTIM)
    total = server.unmask(reveals)
    assert np.array_equal(total, sum(inputs[c].astype(np.uint64) for c in GONE.survivors).astype(np.uint32))


FORGERIES = ["other list", "other round", "other signer", "unregistered", "not a survivor", "empty"]


@pytest.mark.parametrize("forgery", FORGERIES)
def test_secagg_a_forged_or_foreign_survivor_signature_is_not_counted(forgery):
    """Four clients (quorum 3): clients 1 and 2's signatures forged one way; client 0 counts 2 valid signatures and
    refuses, naming the refused ones; the server (with the registered keys) refuses them too."""
    params = SecAggParams(threshold=2, neighbours=3, max_dropouts=1)
    ids = [0, 1, 2, 3]
    clients, server, routed = staged(params, ids)
    inputs = {c: words(13)[c] for c in ids}
    request = server.collect_masked([clients[c].mask(inputs[c], routed[c]) for c in ids])
    signatures = {c: clients[c].check(request) for c in ids}
    assert params.quorum(4) == 3
    keys = {c: identity.simulated([c])[0][c].signing_key for c in (1, 2)}  # keys nobody registered
    reasons = {"other list": "not over this survivor list", "other round": "not over this survivor list",
               "other signer": "not over this survivor list", "unregistered": "no registered node key",
               "not a survivor": "not among the survivors", "empty": "not over this survivor list"}
    forged = dict(signatures)
    for c in (1, 2):
        if forgery == "other list":  # c's own key, another survivor list
            forged[c] = identity.sign_survivors(clients[c].who.signing_key, b"ctx", (0, 1, 2))
        elif forgery == "other round":
            forged[c] = identity.sign_survivors(clients[c].who.signing_key, b"another round", request.survivors)
        elif forgery == "other signer":  # client 3 signs in c's name
            forged[c] = identity.sign_survivors(clients[3].who.signing_key, b"ctx", request.survivors)
        elif forgery == "unregistered":  # a key nobody registered, in c's name, and c unknown to the verifier
            forged[c] = identity.sign_survivors(keys[c], b"ctx", request.survivors)
        elif forgery == "not a survivor":  # a valid-looking signature from a client outside U3
            del forged[c]
            forged[10 + c] = identity.sign_survivors(keys[c], b"ctx", request.survivors)
        else:
            forged[c] = b""
    verifier, registered = clients[0], clients[0].who
    if forgery == "unregistered":
        verifier.who = identity.Identity(registered.signing_key,
                                         {c: k for c, k in registered.peer_keys.items() if c not in (1, 2)})
    with pytest.raises(SecAggError, match=rf"client 0: 2 valid signatures .*client 1?1: [^;]*{reasons[forgery]}"):
        verifier.unmask(request, forged)
    if forgery != "unregistered":
        with pytest.raises(SecAggError, match=r"2 survivors signed the survivor list, fewer than the consistency "):
            server.collect_signatures([SurvivorSignature(c, s) for c, s in forged.items()])
    verifier.who = registered
    assert len(verifier.unmask(request, signatures)) == 3  # the genuine signatures: answered


def test_secagg_a_round_with_fewer_survivors_than_the_quorum_fails_loudly():
    """n = 8, t = 4, k = 6, max_dropouts = 2: the quorum is 6; 2 lost after sharing completes; a client asked to
    sign a list of 5 refuses."""
    params = SecAggParams(threshold=4, neighbours=6, max_dropouts=2)
    clients, _, _, _ = masked_round(params)
    assert params.quorum(8) == 6
    with pytest.raises(SecAggError, match="client 0: 5 survivors, fewer than the consistency quorum 6"):
        clients[0].check(UnmaskRequest((0, 1, 2, 3, 4), (5, 6, 7)))
