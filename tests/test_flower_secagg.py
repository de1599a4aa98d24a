"""SecAgg+ on Flower's apps (``pytest -k secagg``): the ServerApp's executor and the real ClientApp over the loopback
grid of tests/test_flower_apps.py, every node signing its keys with its node key (``fedllm flower certs``) and
verifying its neighbours' against the registered public keys.

- the Flower run equals the one-process SecAgg+ run bit for bit (FedAvg, FRLoRA): the masks cancel exactly modulo
  2^32 and quantisation rounds with the same (seed, round, client) generator on the node as in simulation;
- what the ServerApp receives (masked words) is uncorrelated with each client's true encoded change, while the sum
  recovers the clients' mean;
- a key substituted by the server (man in the middle) is refused by the nodes, the round fails loudly;
- a node whose worker lost the round's secrets (restarted after the share exchange) drops out and the round completes;
  two such nodes (more than max_dropouts) stop the run after a checkpoint, and the resumed run ends equal to the
  uninterrupted simulation bit for bit;
- ``fedllm flower supernode`` hands its worker the node key and the peers' public keys.
"""

import hashlib
import json

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from fedllm.engine.client_faults import RoundStopped
from fedllm.engine.server import run
from fedllm.flower import records, secagg_stages
from fedllm.flower.certs import write_node_keys
from fedllm.flower.executor import FlowerExecutor
from fedllm.flower.server_app import read_node_keys
from fedllm.privacy.secagg.encoding import decode, encode
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schedule import derived_seed, steps_per_round
from fedllm.runs import checkpoint as ckpt_io
from tests.test_flower_apps import LoopbackGrid, assert_close, flower_identity, nodes, parts  # noqa: F401 (a fixture)

CLIENTS = 4
SECAGG = {"secure_aggregation": "secagg_plus", "secagg": {"neighbours": 3, "max_dropouts": 1}}


@pytest.fixture(scope="module")
def node_keys(tmp_path_factory):
    directory = tmp_path_factory.mktemp("keys")
    write_node_keys(directory, CLIENTS)
    return directory


def signed_nodes(tmp_path, keys):
    """Node configs as ``fedllm flower supernode --auth-key`` gives them: the node key and the peers' public keys."""
    return [{**cfg, "node-key": str(keys / f"client-{i}.key"), "peer-keys": str(keys)}
            for i, cfg in enumerate(nodes(tmp_path, CLIENTS))]


# client-side DP under SecAgg+: clients clip, the adaptive norm's unclipped bits are summed securely, the server adds
# the noise to the unmasked sum
CLIENT_DP = {"mechanism": "central_client_clipping", "noise_multiplier": 0.5, "clipping_norm": 0.05, "noise_seed": 3,
             "adaptive_clipping": {"enabled": True, "count_stddev": 1}}


def raw_recipe(tiny_recipe, strategy="fedavg", rounds=2, privacy=None, **federation):
    return tiny_recipe(federation={"num_clients": CLIENTS, "clients_per_round": CLIENTS, "rounds": rounds,
                                   "strategy": strategy, **federation}, privacy={**SECAGG, **(privacy or {})})


def flower_run(raw, tmp_path, keys, grid=None, name="flower"):
    grid = grid or LoopbackGrid(signed_nodes(tmp_path, keys))
    executor = FlowerExecutor(grid, node_keys=read_node_keys(str(keys)))
    return run(parse_recipe({**raw, "output_dir": str(tmp_path / name)}), executor=executor), grid


@pytest.mark.parametrize("case", ["fedavg", "frlora", "fedavg-client-dp"])
@pytest.mark.usefixtures("flower_identity")
def test_secagg_on_flower_equals_the_simulation_bit_for_bit(case, tiny_recipe, tmp_path, node_keys):
    raw = raw_recipe(tiny_recipe, case.split("-")[0], privacy=CLIENT_DP if case.endswith("dp") else None)
    sim = run(parse_recipe({**raw, "output_dir": str(tmp_path / "sim")}))
    flower, grid = flower_run(raw, tmp_path, node_keys)
    expected, got = parts(sim.run_dir), parts(flower.run_dir)
    assert_close(expected["adapter"], got["adapter"], "global adapter", tol=0.0)
    if "base" in expected:  # FRLoRA: the base merged from the unmasked mean
        assert_close(expected["base"], got["base"], "server base", tol=0.0)
    for s, f in zip(sim.history, flower.history, strict=True):
        assert s["secure_aggregation"]["masked_bytes_per_client"] == f["secure_aggregation"]["masked_bytes_per_client"]
        assert f["secure_aggregation"]["dropped_after_sharing"] == [] and "dropped" not in f
    # the key advertisement rides on the share exchange: 3 extra round trips a round, and a hello in the first
    stages = [m.content.config_records["secagg"]["stage"] for m in grid.messages
              if m.metadata.message_type == "query.secagg"]
    assert stages == [s for s in ("hello", "keys", "check", "unmask", "keys", "check", "unmask") for _ in range(CLIENTS)]
    # every train reply carried masked words only (never the client's update)
    for reply in grid.replies:
        if "update" in reply.content.array_records:
            assert list(records.decode(reply.content.array_records["update"])) == ["secagg/masked"]
    assert_no_per_client_statistics(raw, sim, flower, grid)


def assert_no_per_client_statistics(raw, sim, flower, grid):
    """Issue 49 item 5: no train reply carries its client's loss or token counts, only what the server holds already
    (the partition's size and the schedule's steps), and no metrics.jsonl line holds a per-client statistic."""
    recipe = parse_recipe(raw)
    sizes = ckpt_io.load_checkpoint(flower.run_dir / "final").meta["client_sizes"]
    replies = [r for r in grid.replies if "update" in r.content.array_records]
    assert len(replies) == CLIENTS * recipe.federation.rounds
    for reply in replies:
        metrics = dict(reply.content.metric_records["metrics"])
        assert set(metrics) == {"client_id", "num_examples", "steps", "synced", "step"}, metrics
        n = sizes[int(metrics["client_id"])]
        assert (metrics["num_examples"], metrics["steps"]) == (n, steps_per_round(recipe.train, n))
    for line in [*sim.history, *flower.history]:
        assert not {"client_loss", "train_loss", "client_steps", "bytes_up", "bytes_down", "throughput",
                    "padded_fraction"} & set(line), line
        assert "protocol_bytes_up" not in line["secure_aggregation"] and line["steps_total"] > 0


@pytest.mark.usefixtures("flower_identity")
def test_secagg_the_serverapp_receives_masked_words_uncorrelated_with_each_update(
        tiny_recipe, tmp_path, node_keys, monkeypatch):
    """Capture, on the node, each client's true encoded change (what it would send in the clear) and, on the server,
    the train replies: no reply equals or correlates with its client's change, and the decoded sum is their mean."""
    truth, start = {}, {}
    original = secagg_stages.mask_upload

    def spy(update, reference, weight, seed, rnd, layout, params, client, shares, **options):
        rng = np.random.default_rng(derived_seed(seed, rnd, update.client_id, 0x5EC))
        truth[(rnd, update.client_id)] = (encode(update.state, reference, weight, layout, params, rng)[0], params,
                                          layout)
        start.update(reference)
        return original(update, reference, weight, seed, rnd, layout, params, client, shares, **options)

    monkeypatch.setattr(secagg_stages, "mask_upload", spy)
    flower, grid = flower_run(raw_recipe(tiny_recipe, rounds=1), tmp_path, node_keys)
    received = {}
    for message, reply in zip(grid.messages, grid.replies, strict=True):
        if message.metadata.message_type == "train":
            cid = int(message.content.config_records["fedllm"]["client_id"])
            received[cid] = records.decode(reply.content.array_records["update"])["secagg/masked"].numpy()
    assert sorted(received) == list(range(CLIENTS))
    total, pooled = None, ([], [])
    for cid, masked in received.items():
        x, params, layout = truth[(1, cid)]
        y = masked.view(np.uint32)
        assert y.size == x.size > 1000 and not np.array_equal(y, x)
        assert abs(np.corrcoef(y.astype(np.float64), x.astype(np.float64))[0, 1]) < 0.1  # n ≈ 2.6k: std 0.02
        assert abs(y.mean() / 2**32 - 0.5) < 0.05  # uniform words; the encoded change sits near 2^19
        total = y.copy() if total is None else total + y
        pooled[0].append(y.astype(np.float64))
        pooled[1].append(x.astype(np.float64))
    # all clients' words together (n ≈ 10k: the estimate's standard deviation is 0.01)
    assert abs(np.corrcoef(np.concatenate(pooled[0]), np.concatenate(pooled[1]))[0, 1]) < 0.05
    words = sum(truth[(1, c)][0] for c in range(CLIENTS))  # the true sum of the encoded changes
    assert abs(np.corrcoef(total.astype(np.float64), words.astype(np.float64))[0, 1]) < 0.1  # still masked
    # the sum recovers: the global adapter the server applied is the start plus the mean decoded from the true sum
    decoded = decode(words, layout, params)
    assert decoded.count == CLIENTS and decoded.clipped == 0
    got = parts(flower.run_dir)["adapter"]
    for key, mean in decoded.means(layout).items():
        expected = (start[key].double() + mean).to(got[key].dtype)
        assert torch.equal(got[key], expected), key
    assert any(torch.count_nonzero(m) for m in decoded.means(layout).values())


@pytest.mark.usefixtures("flower_identity")
def test_secagg_per_client_statistics_only_when_the_recipe_opts_in(tiny_recipe, tmp_path, node_keys):
    """``privacy.per_client_stats: true`` restores each client's loss and token counts in the train replies (beside
    the masked words) and in metrics.jsonl, as before issue 49 item 5."""
    raw = raw_recipe(tiny_recipe, rounds=1, privacy={"per_client_stats": True})
    flower, grid = flower_run(raw, tmp_path, node_keys)
    replies = [r for r in grid.replies if "update" in r.content.array_records]
    assert len(replies) == CLIENTS
    for reply in replies:
        metrics = dict(reply.content.metric_records["metrics"])
        assert metrics["loss"] > 0 and metrics["work.tokens"] > 0
    line = flower.history[0]
    assert sorted(line["client_loss"]) == sorted(line["bytes_up"]) == [str(c) for c in range(CLIENTS)]
    assert line["train_loss"] > 0 and line["throughput"]["tokens"] > 0


@pytest.mark.parametrize("key", ["encryption", "masking"])
@pytest.mark.usefixtures("flower_identity")
def test_secagg_a_key_substituted_by_the_server_is_refused_by_the_nodes(key, tiny_recipe, tmp_path, node_keys,
                                                                        monkeypatch, caplog):
    """The server forwards client 2's neighbours a key of its own (a man in the middle): its encryption key in the
    ``keys`` message, or its masking key of the round in the ``train`` message. Every node verifies the signature
    against client 2's registered node key and refuses; the round fails loudly."""
    from fedllm.privacy.secagg import crypto

    _, forged = crypto.new_key_pair()
    if key == "encryption":
        ask = secagg_stages.FlowerSecureRound._ask

        def substitute(self, clients, stage, fields):
            if stage != "keys":
                return ask(self, clients, stage, fields)

            def forged_fields(c):
                out = fields(c)
                out["encryption_keys"] = [forged if i == 2 else k for i, k in zip(out["ids"], out["encryption_keys"])]
                return out
            return ask(self, clients, stage, forged_fields)

        monkeypatch.setattr(secagg_stages.FlowerSecureRound, "_ask", substitute)
    else:
        attach = secagg_stages.FlowerSecureRound.attach

        def substitute(self, messages, sent):
            attach(self, messages, sent)
            for m in messages:
                record = m.content.config_records["secagg"]
                record["masking_keys"] = [forged if i == 2 else k for i, k in zip(record["ids"],
                                                                                   record["masking_keys"])]

        monkeypatch.setattr(secagg_stages.FlowerSecureRound, "attach", substitute)
    with pytest.raises(RoundStopped):
        flower_run(raw_recipe(tiny_recipe, rounds=1, round_retries=0), tmp_path, node_keys,
                   grid=RestartingGrid(signed_nodes(tmp_path, node_keys), lose={}))
    if key == "encryption":
        assert "client 2's SecAgg+ encryption key is not signed by its registered node key" in caplog.text
        assert "secure aggregation cannot start" in caplog.text
    else:
        assert caplog.text.count("client 2's SecAgg+ keys are not signed by its registered node key") == 3
        assert "secure aggregation failed" in caplog.text


@pytest.mark.usefixtures("flower_identity")
def test_secagg_a_node_refuses_a_neighbour_graph_seed_it_does_not_derive(tiny_recipe, tmp_path, node_keys,
                                                                          monkeypatch, caplog):
    """Issue 49 item 6: the graph seed used to be a nonce of the ServerApp's (``os.urandom``) that nodes took as
    given, so a server could try nonces until the neighbourhoods suited it. Now it is the hash of the round's signed
    encryption keys; a ServerApp that sends any other seed (with neighbours to match) is refused by every node."""
    ask = secagg_stages.FlowerSecureRound._ask

    def chosen_seed(self, clients, stage, fields):
        if stage != "keys":
            return ask(self, clients, stage, fields)
        self.graph_seed = bytes(16)  # the server's pick; it routes by the graph of its own seed
        self.server = secagg_stages.SecAggServer(self.params, self.sampled, self.graph_seed, self.context,
                                                 self.peer_keys)
        return ask(self, clients, stage, fields)

    monkeypatch.setattr(secagg_stages.FlowerSecureRound, "_ask", chosen_seed)
    with pytest.raises(RoundStopped):
        flower_run(raw_recipe(tiny_recipe, rounds=1, round_retries=0), tmp_path, node_keys,
                   grid=RestartingGrid(signed_nodes(tmp_path, node_keys), lose={}))
    assert caplog.text.count("refused the round's neighbour graph: its seed 00000000") == CLIENTS
    assert "secure aggregation cannot start" in caplog.text


def test_secagg_graph_seed_is_the_hash_of_the_round_and_its_keys():
    keys = {0: b"a" * 32, 1: b"b" * 32, 3: b"c" * 32}
    seed = secagg_stages.graph_seed_of("run", 2, [0, 1, 2, 3], keys)
    named = repr(("fedllm-secagg-graph", "run", 2, [0, 1, 2, 3], [(0, "61" * 32), (1, "62" * 32), (3, "63" * 32)]))
    assert seed == hashlib.sha256(named.encode()).digest()[:16]
    assert secagg_stages.graph_seed_of("run", 2, [3, 2, 1, 0], dict(reversed(keys.items()))) == seed  # no order
    for changed in ({**keys, 3: b"d" * 32}, {0: keys[0], 1: keys[1]}):  # a new key, a client left out
        assert secagg_stages.graph_seed_of("run", 2, [0, 1, 2, 3], changed) != seed
    assert secagg_stages.graph_seed_of("run", 3, [0, 1, 2, 3], keys) != seed


class RestartingGrid(LoopbackGrid):
    """A loopback grid whose nodes in ``lose[round]`` restart their worker after the share exchange (their in-memory
    SecAgg+ secrets are gone when the round's train message arrives)."""

    def __init__(self, node_configs, lose):
        super().__init__(node_configs)
        self.lose = lose

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.app import Message
        from flwr.app.error import Error

        replies = []
        for m in messages:
            if m.metadata.message_type == "train":
                head = m.content.config_records["fedllm"]
                cid = int(head["client_id"])
                if cid in self.lose.get(int(head["round"]), ()):
                    secagg_stages._ROUNDS.pop((str(head["token"]), cid), None)
            try:  # as fedllm's worker (fedllm.flower.runtime.run_client_task): a raising app answers an error
                replies += super().send_and_receive([m], timeout=timeout)
            except Exception as e:  # noqa: BLE001
                replies.append(Message(Error(code=1, reason=str(e)), reply_to=m))
        return replies


@pytest.mark.usefixtures("flower_identity")
def test_secagg_a_worker_that_lost_its_secrets_drops_out_and_the_round_completes(
        tiny_recipe, tmp_path, node_keys):
    """Client 1's worker restarts after the share exchange (its in-memory secrets are gone): its train message is
    answered with an error, it counts as lost after sharing, and the three others' sum is unmasked."""

    grid = RestartingGrid(signed_nodes(tmp_path, node_keys), lose={1: {1}})
    flower, _ = flower_run(raw_recipe(tiny_recipe, rounds=1), tmp_path, node_keys, grid=grid)
    record = flower.history[0]
    assert record["secure_aggregation"]["dropped_after_sharing"] == [1]
    assert "no SecAgg+ secrets for round 1" in record["dropped"]["1"]
    assert sorted(c for c in record["clients"] if str(c) not in record.get("dropped", {})) == [0, 2, 3]  # summed
    assert json.dumps(record)  # the run's record stays JSON


@pytest.mark.usefixtures("flower_identity")
def test_secagg_more_lost_nodes_than_max_dropouts_stop_the_run_and_it_resumes_bit_for_bit(
        tiny_recipe, tmp_path, node_keys, caplog):
    """Round 2 loses two workers' secrets (max_dropouts=1): the round fails loudly, the run stops after round 1's
    checkpoint; resumed with the nodes back, it ends equal to the uninterrupted one-process SecAgg+ run."""
    raw = raw_recipe(tiny_recipe, rounds=2, round_retries=0)
    sim = run(parse_recipe({**raw, "output_dir": str(tmp_path / "sim")}))
    configs = signed_nodes(tmp_path, node_keys)
    with pytest.raises(RoundStopped):
        flower_run(raw, tmp_path, node_keys, grid=RestartingGrid(configs, lose={2: {1, 2}}))
    assert "secure aggregation failed: 2 clients ([1, 2]) were lost after sharing their keys, more than " \
           "max_dropouts=1" in caplog.text
    executor = FlowerExecutor(LoopbackGrid(configs), node_keys=read_node_keys(str(node_keys)))
    resumed = run(parse_recipe({**raw, "output_dir": str(tmp_path / "flower")}), resume=True, executor=executor)
    assert [h["secure_aggregation"]["dropped_after_sharing"] for h in resumed.history] == [[], []]
    assert_close(parts(sim.run_dir)["adapter"], parts(resumed.run_dir)["adapter"], "resumed adapter", tol=0.0)


def test_secagg_supernode_gives_its_worker_the_node_key_and_the_peers_public_keys(node_keys, tmp_path):
    """``fedllm flower supernode --auth-key`` hands the worker (``--node-config``) the key that signs the node's SecAgg+
    keys and the directory of every client's public key (default: beside the key); a ``--peer-keys`` without
    ``client-K.pub`` files is refused with what is expected."""
    import argparse

    from fedllm.commands.flower import add_flower_arguments, supernode_command
    from fedllm.common.errors import InputError

    (tmp_path / "ca.crt").write_text("x")

    def command(*extra):
        parser = argparse.ArgumentParser()
        add_flower_arguments(parser)
        args = parser.parse_args(["supernode", "--superlink", "127.0.0.1:9092", "--client", "2", "--root-certificates",
                                  str(tmp_path / "ca.crt"), "--auth-key", str(node_keys / "client-2.key"), *extra])
        cmd = supernode_command(args, None)
        return cmd[cmd.index("--node-config") + 1]

    config = command()
    assert f"node-key='{node_keys / 'client-2.key'}'" in config and f"peer-keys='{node_keys}'" in config
    with pytest.raises(InputError, match=r"--peer-keys=.*: no client-K.pub files; expected the nodes/ directory"):
        command("--peer-keys", str(tmp_path))


@pytest.mark.usefixtures("flower_identity")
def test_secagg_a_serverapp_lying_about_a_dropout_is_refused_by_the_nodes(tiny_recipe, tmp_path, node_keys,
                                                                          monkeypatch, caplog):
    """The ServerApp tells nodes 0 and 3 that all four survived and nodes 1 and 2 that client 3 dropped (to get
    shares of both b_3 and s_3), and skips its own signature check: each node signs what it was told, sees only 2
    valid signatures over its list (the quorum is 3) and refuses; no share is revealed and the round fails loudly,
    naming the inconsistency."""
    from fedllm.privacy.secagg import SecAggServer, SurvivorSignature, UnmaskRequest

    def story(c, request):
        return request if c in (0, 3) else UnmaskRequest((0, 1, 2), (3,))

    def lists(request):
        return {"survivors": list(request.survivors), "dropped": list(request.dropped)}

    def lying_check(self, request):
        out = []
        for c in request.survivors:
            answers = self._ask([c], "check", lambda _, c=c: lists(story(c, request)))
            out += [SurvivorSignature(cid, bytes(a["signature"])) for cid, a in answers.items()]
        return out

    def lying_reveal(self, request, signatures):
        signers = sorted(signatures)
        for c in signers:
            self._ask([c], "unmask", lambda _, c=c: {**lists(story(c, request)), "signers": signers,
                                                     "signatures": [signatures[v] for v in signers]})
        return []

    monkeypatch.setattr(secagg_stages.FlowerSecureRound, "check", lying_check)
    monkeypatch.setattr(secagg_stages.FlowerSecureRound, "reveal", lying_reveal)
    def forward_all(self, signed):  # no check of its own: every signature goes to every node
        self.signers = {s.client_id: s.signature for s in signed}
        return self.signers

    monkeypatch.setattr(SecAggServer, "collect_signatures", forward_all)
    grid = RestartingGrid(signed_nodes(tmp_path, node_keys), lose={})
    with pytest.raises(RoundStopped):
        flower_run(raw_recipe(tiny_recipe, rounds=1, round_retries=0), tmp_path, node_keys, grid=grid)
    assert caplog.text.count("secure aggregation (unmask) failed on its node") == CLIENTS  # no node revealed a share
    for c, told in ((1, "[0, 1, 2]"), (3, "[0, 1, 2, 3]")):
        assert (f"client {c}: 2 valid signatures over the survivor list {told}, fewer than the consistency quorum 3"
                in caplog.text)
    assert "the server sent other clients another list" in caplog.text
    assert "secure aggregation failed: 0 shares of client 0's self-mask seed arrived" in caplog.text


def without_version(reply, msg):
    from flwr.app import ConfigRecord, Message, RecordDict

    record = reply.content.config_records["secagg"]
    old = ConfigRecord({k: v for k, v in record.items() if k != "version"})
    return Message(RecordDict({"secagg": old}), reply_to=msg)


@pytest.mark.usefixtures("flower_identity")
def test_secagg_a_node_or_a_serverapp_on_the_old_protocol_is_refused_with_a_clear_message(
        tiny_recipe, tmp_path, node_keys, monkeypatch, caplog):
    """Wire format version 3 (the graph seed from the nodes' keys): a node answering like version 1 (no ``version``) is left out
    at the key advertisement with a message saying so (the round cannot start: no hang); a node sent a version-1
    message refuses it."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from fedllm.privacy.secagg import SecAggError

    answer = secagg_stages.answer_stage
    monkeypatch.setattr(secagg_stages, "answer_stage", lambda msg, context: without_version(answer(msg, context), msg))
    with pytest.raises(RoundStopped):
        flower_run(raw_recipe(tiny_recipe, rounds=1, round_retries=0), tmp_path, node_keys)
    assert "its node speaks SecAgg+ protocol version 1, this ServerApp 3" in caplog.text
    assert "secure aggregation cannot start" in caplog.text

    old = Message(RecordDict({"secagg": ConfigRecord({"stage": "advertise", "token": "t", "round": 1,
                                                        "context": b"c"})}),
                  dst_node_id=100, message_type=secagg_stages.MESSAGE_TYPE)
    context = Context(run_id=1, node_id=100, node_config=signed_nodes(tmp_path, node_keys)[0], state=RecordDict(),
                      run_config={})
    with pytest.raises(SecAggError, match="client 0: the ServerApp speaks SecAgg\\+ protocol version 1, this node 3"):
        answer(old, context)


class ForgettingGrid(RestartingGrid):
    """A loopback grid whose nodes in ``forget[round]`` restart their worker between rounds, unnoticed: the new
    worker has no encryption key when the round's ``keys`` message arrives."""

    def __init__(self, node_configs, forget):
        super().__init__(node_configs, lose={})
        self.forget = forget

    def send_and_receive(self, messages, *, timeout=None):
        for m in messages:
            record = m.content.config_records.get("secagg")
            if m.metadata.message_type == "query.secagg" and record["stage"] == "keys":
                cid = m.metadata.dst_node_id - 100
                if cid in self.forget.get(int(record["round"]), ()):
                    secagg_stages._ENCRYPTION_KEYS.pop((str(record["token"]), cid), None)
        return super().send_and_receive(messages, timeout=timeout)


@pytest.mark.usefixtures("flower_identity")
def test_secagg_a_worker_restarted_between_rounds_sits_one_round_out_and_says_hello_again(
        tiny_recipe, tmp_path, node_keys):
    """Client 1's worker restarts before round 2 without the ServerApp noticing: its neighbours encrypt its shares to
    its old key, it refuses round 2's ``keys`` message (lost before sharing; the round completes from the three
    others) and says hello again in round 3, which it serves."""
    grid = ForgettingGrid(signed_nodes(tmp_path, node_keys), forget={2: {1}})
    flower, _ = flower_run(raw_recipe(tiny_recipe, rounds=3), tmp_path, node_keys, grid=grid)
    assert "its SecAgg+ encryption key is not the one the ServerApp holds" in flower.history[1]["dropped"]["1"]
    second, third = flower.history[1], flower.history[2]
    assert sorted(c for c in second["clients"] if str(c) not in second.get("dropped", {})) == [0, 2, 3]  # summed
    assert third["clients"] == [0, 1, 2, 3] and "dropped" not in third
    hellos = [int(m.content.config_records["secagg"]["round"]) for m in grid.messages
              if m.metadata.message_type == "query.secagg" and m.content.config_records["secagg"]["stage"] == "hello"]
    assert hellos == [1] * CLIENTS + [3]
