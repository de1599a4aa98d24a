"""The Flower ServerApp/ClientApp logic against the in-process simulation, without a network.

A loopback grid hands each message straight to the real ClientApp (``fedllm.flower.client_app.app``)
with the node's ``--node-config``; everything else (adapter, executor, node state directories, catch-up,
server checkpoints) is the code a real deployment runs. tests/test_flower_deployment.py runs the same
over a real SuperLink and SuperNodes.
"""

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedllm.engine.server import run  # noqa: E402
from fedllm.flower import records  # noqa: E402
from fedllm.flower.client_app import app as client_app  # noqa: E402
from fedllm.flower.executor import FlowerExecutor  # noqa: E402
from fedllm.models.state import cast  # noqa: E402
from fedllm.recipe.checks import parse_recipe  # noqa: E402
from fedllm.runs.base_history import load_base  # noqa: E402


class LoopbackGrid(Grid):
    """A grid whose nodes are ClientApp calls in this process (node id 100 + client id)."""

    def __init__(self, node_configs):
        self.nodes = {100 + i: cfg for i, cfg in enumerate(node_configs)}
        self.sent = []
        self.messages = []
        self.replies = []

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for m in messages:
            self.sent.append(m.metadata.message_type)
            self.messages.append(m)
            node = m.metadata.dst_node_id
            replies.append(client_app(m, Context(run_id=1, node_id=node, node_config=self.nodes[node],
                                                 state=RecordDict(), run_config={})))
        self.replies += replies
        return replies

    def set_run(self, run):
        raise NotImplementedError

    @property
    def run(self):
        raise NotImplementedError

    def create_message(self, *args, **kwargs):
        raise NotImplementedError

    def push_messages(self, messages):
        raise NotImplementedError

    def pull_messages(self, message_ids):
        raise NotImplementedError


@pytest.fixture
def flower_identity(monkeypatch):
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


def nodes(tmp_path, n):
    return [{"partition-id": i, "state-dir": str(tmp_path / f"node{i}")} for i in range(n)]


def parts(run_dir):
    return {p: load_file(str(f)) for p in ("adapter", "base", "strategy", "clients")
            if (f := run_dir / "final" / f"{p}.safetensors").is_file()}


def node_state(tmp_path, cid):
    """Newest saved state of client ``cid`` on its node (its base rebuilt from the snapshot and log)."""
    steps = sorted((tmp_path / f"node{cid}").glob("*/client-*/step-*"))
    state = {p: load_file(str(f)) for p in ("clients",) if (f := steps[-1] / f"{p}.safetensors").is_file()}
    base = load_base(steps[-1])
    return {**state, "base": base} if base else state


def assert_close(a, b, what, tol=1e-6):
    assert a.keys() == b.keys(), what
    worst = max((float((a[k].float() - b[k].float()).abs().max()) for k in a), default=0.0)
    assert worst <= tol, f"{what}: max abs difference {worst}"


CASES = {
    "fedavg": ("fedavg", {}, {}),
    "frlora": ("frlora", {}, {}),
    "frlora-moments": ("frlora", {}, {"train": {"optimizer_state": "per_client"}}),
    "pfedloru": ("pfedloru", {"personal_r": 2, "personal_steps": 1, "tau": 2}, {}),
    "scaffold": ("scaffold", {}, {}),
    "fedloru": ("fedloru", {"tau": 2, "reinit": "momentum"}, {"train": {"optimizer_state": "per_client"}}),
    "fedsa_lora": ("fedsa_lora", {}, {}),
    "fedadam": ("fedadam", {"eta": 1e-2}, {}),
    # client-side DP clipping runs on the nodes (the norm goes out in the plan, the unclipped bit comes back)
    "fedavg-client-dp": ("fedavg", {}, {"privacy": {"mechanism": "central_client_clipping", "noise_multiplier": 0.5,
                                                    "clipping_norm": 0.05, "noise_seed": 3, "per_client_stats": True,
                                                    "adaptive_clipping": {
                                                        "enabled": True, "count_stddev": 1}}}),
    # DP-SGD on the nodes: Poisson batches and noise seeded per (noise_seed, round, client), steps reported back
    "fedavg-dp-sgd": ("fedavg", {}, {"privacy": {"mechanism": "dp_sgd", "noise_multiplier": 0.8, "clipping_norm": 0.5,
                                                 "delta": 1e-3, "noise_seed": 5}}),
    "fedavg-packing": ("fedavg", {}, {"train": {"packing": True}}),  # nodes pack their micro-batches as one process
    "fedex_lora": ("fedex_lora", {}, {}),  # merges in aggregate: nodes replay the server's logged low-rank merges
    # heterogeneous ranks (lora.r = 4): each node trains and keeps a rank-r_k slice of the shared adapter
    "flora-ranks": ("flora", {"client_ranks": [2, 4, 3]}, {}),
    "flexlora-ranks": ("flexlora", {"client_ranks": [2, 4, 3]}, {}),
    # the node decides its pruning from the plan alone (its rank travels in the plan); the server learns it
    "hetlora-ranks": ("hetlora", {"client_ranks": [2, 4, 3], "gamma": 0.5, "prune_lambda": 5.0}, {}),
    "rolora": ("rolora", {}, {"train": {"optimizer_state": "per_client"}}),  # one factor per round, moments kept
    "lora_fair": ("lora_fair", {}, {}),
    "fedsvd": ("fedsvd", {}, {"train": {"optimizer_state": "per_client"}}),  # A refactorised on the server, sent down
    "fed_sb": ("fed_sb", {}, {}),  # A and B reach a node once and stay in its client's state; R travels
    # train.compile on the nodes (dynamo's eager backend here): compiled layers, loss chunk and FRLoRA's residual
    # hooks as in one process; each node's model compiles its own graphs, once, kept warm between messages as
    # fedllm's node worker keeps it (WorkerGrid); 2 rounds: round 2's nodes already catch up on round 1's merges, and
    # all 3 on the last after it
    "frlora-compile": ("frlora", {}, {"train": {"compile": True}, "rounds": 2}),
    # activation checkpointing on the nodes: FRLoRA's residual hooks run again in each layer's recompute
    "frlora-checkpointing": ("frlora", {}, {"train": {"gradient_checkpointing": True}}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_flower_apps_match_the_simulation(case, tiny_recipe, tmp_path, flower_identity, monkeypatch):
    strategy, args, sections = CASES[case]
    sections = dict(sections)
    rounds = sections.pop("rounds", 3)
    compile_ = bool(sections.get("train", {}).get("compile"))
    if compile_:
        from fedllm.engine import compiled

        monkeypatch.setattr(compiled, "BACKEND", "eager")  # tracing and graphs, no inductor code generation
    fed = {"num_clients": 3, "clients_per_round": 2, "rounds": rounds, "strategy": strategy, "strategy_args": args}
    raw = tiny_recipe(federation=fed, **sections)
    # under train.compile the simulation runs eagerly: the compiled nodes must equal plain eager training
    one_process = {**raw, "train": {**raw["train"], "compile": False}} if compile_ else raw
    sim = run(parse_recipe({**one_process, "output_dir": str(tmp_path / "sim")}))
    grid = (WorkerGrid if compile_ else LoopbackGrid)(nodes(tmp_path, 3))  # a node compiles once, not per message
    flower = run(parse_recipe({**raw, "output_dir": str(tmp_path / "flower")}), executor=FlowerExecutor(grid))
    expected, got = parts(sim.run_dir), parts(flower.run_dir)
    assert_close(expected["adapter"], got["adapter"], "global adapter")
    assert "clients" not in got  # per-client state never reaches the server
    if compile_:  # the nodes trained compiled: every layer of a trained node's model holds its compiled call
        from fedllm.engine.compiled import KEPT, repeated_blocks

        models = [node.fed.loaded.model for cache in grid.caches.values() for node, _ in cache.nodes.values()]
        assert sum(all(KEPT in layer.__dict__ for layer in repeated_blocks(m)) for m in models) >= 2  # round 1's two
    if "base" in expected:
        assert_close(expected["base"], got["base"], "server base")
    for cid in range(3):
        on_node = node_state(tmp_path, cid)
        if "base" in expected:  # every node, participating or not, ends with the server's base W^T
            assert_close(expected["base"], on_node["base"], f"base on node {cid}")
            newest = sorted((tmp_path / f"node{cid}").glob("*/client-*/step-*"))[-1]
            assert (newest / "base-history.json").is_file()  # kept as a snapshot plus a log of merges
        sim_entry = {k.split("/", 1)[1]: v for k, v in expected.get("clients", {}).items()
                     if k.startswith(f"client{cid}/")}
        node_entry = {k.split("/", 1)[1]: v for k, v in on_node.get("clients", {}).items()}
        assert_close(sim_entry, node_entry, f"per-client state of client {cid}")
    losses = [h.get("train_loss") for h in sim.history]  # DP-SGD: none uploaded, none on either side
    assert [h.get("train_loss") for h in flower.history] == (losses if None in losses else pytest.approx(losses,
                                                                                                          abs=1e-6))
    if "privacy" in sections:  # the server accounts the same epsilon (per client for DP-SGD) every round
        for key in ("epsilon", "client_epsilon"):
            assert [h.get(key) for h in flower.history] == [h.get(key) for h in sim.history], key
        assert flower.history[-1]["epsilon"] > 0
    if strategy == "fedavg":
        assert [h["bytes_down_total"] for h in flower.history] == [h["bytes_down_total"] for h in sim.history]
        assert "train.sync" not in grid.sent
        counted = ("tokens", "supervised_tokens", "positions", "flops")  # throughput: the nodes' counts come back
        assert [[h["throughput"][k] for k in counted] for h in flower.history] == \
            [[h["throughput"][k] for k in counted] for h in sim.history]
        assert all(h["throughput"]["tokens_per_s"] > 0 for h in flower.history)
    if strategy == "frlora":
        # catch-up: the clients of round 1 applied nothing before it; 2 clients x rounds 1..3 arrive later
        assert grid.sent.count("train.sync") == 3
    # catch-up is compact: factors (one side at most the rank r = 4, or a coefficient), never a dense matrix
    synced = [a for m in grid.messages for name, rec in m.content.array_records.items() if name.startswith("sync.")
              for a in records.decode(rec).values()]
    assert bool(synced) == (strategy in ("frlora", "pfedloru", "fedloru", "fedex_lora", "flora"))
    stacked = 8 if strategy == "flora" else 4  # FLoRA's stack has the rank r_i + r_j of the round's two clients
    assert all(min(a.shape) <= stacked for a in synced)


@pytest.mark.parametrize("rounds,every", [(3, 1), (4, 2)])
def test_flower_server_resumes_after_a_crash(rounds, every, tiny_recipe, tmp_path, flower_identity, crash_at_round):
    """A server that dies in the last round resumes from its newest checkpoint (with every=2 that is two
    rounds back: the nodes hand back the state they had then, the server the aggregates they missed)."""
    fed = {"num_clients": 3, "clients_per_round": 2, "rounds": rounds, "strategy": "frlora"}
    raw = tiny_recipe(federation=fed, train={"optimizer_state": "per_client"})
    sim = parts(run(parse_recipe({**raw, "output_dir": str(tmp_path / "sim")})).run_dir)
    recipe = parse_recipe({**raw, "output_dir": str(tmp_path / "flower"), "checkpoint": {"every": every}})
    crash_at_round(rounds)
    with pytest.raises(RuntimeError, match="power cut"):
        run(recipe, executor=FlowerExecutor(LoopbackGrid(nodes(tmp_path, 3))))
    crash_at_round(None)
    # a new server process: new executor, new grid (node ids could change), same node state directories
    resumed = run(recipe, resume=True, executor=FlowerExecutor(LoopbackGrid(nodes(tmp_path, 3))))
    got = parts(resumed.run_dir)
    assert_close(sim["adapter"], got["adapter"], "global adapter")
    assert_close(sim["base"], got["base"], "base")
    assert [h["round"] for h in resumed.history] == list(range(1, rounds + 1))


def test_flower_hetlora_server_resumes_with_the_ranks_its_clients_pruned(tiny_recipe, tmp_path, flower_identity,
                                                                        crash_at_round):
    """HetLoRA's server keeps every client's current rank (learned from the uploads' shapes): a server that dies
    in round 3 resumes from round 2's checkpoint with the pruned ranks and ends as the simulation does."""
    fed = {"num_clients": 3, "clients_per_round": 3, "rounds": 3, "strategy": "hetlora",
           "strategy_args": {"client_ranks": [4, 2, 3], "gamma": 0.5, "prune_lambda": 5.0}}
    raw = tiny_recipe(federation=fed)
    sim = run(parse_recipe({**raw, "output_dir": str(tmp_path / "sim")}))
    recipe = parse_recipe({**raw, "output_dir": str(tmp_path / "flower"), "checkpoint": {"every": 1}})
    crash_at_round(3)
    with pytest.raises(RuntimeError, match="power cut"):
        run(recipe, executor=FlowerExecutor(LoopbackGrid(nodes(tmp_path, 3))))
    assert load_file(str(tmp_path / "flower" / "checkpoints" / "round-0002" / "strategy.safetensors"))[
        "ranks"].tolist() != [4, 2, 3]  # some client pruned before the checkpoint the server resumes from
    crash_at_round(None)
    resumed = run(recipe, resume=True, executor=FlowerExecutor(LoopbackGrid(nodes(tmp_path, 3))))
    assert resumed.strategy.current == sim.strategy.current
    assert_close(parts(sim.run_dir)["adapter"], parts(resumed.run_dir)["adapter"], "global adapter")


def test_records_carry_the_wire_dtype_exactly():
    gen = torch.Generator().manual_seed(0)
    state = {"a.weight": torch.randn(3, 5, generator=gen), "n": torch.tensor([1, 2, 3])}
    for comm in ("fp32", "bf16", "fp16"):
        record = records.encode(state, comm)
        back = records.decode(record)
        want = cast(state, comm)
        assert all(back[k].dtype == state[k].dtype and torch.equal(back[k], want[k]) for k in state)
        size = {"fp32": 4, "bf16": 2, "fp16": 2}[comm]
        assert records.record_bytes(record) == 15 * size + 3 * 8  # floats travel as comm_dtype, ints as they are
    extra = {"c": {"x": torch.ones(2)}, "t": torch.zeros(1), "mu": 0.5}
    tensors, rest = records.split_extra(extra)
    joined = records.join_extra(tensors, rest)
    assert joined["mu"] == 0.5 and torch.equal(joined["c"]["x"], torch.ones(2)) and torch.equal(joined["t"],
                                                                                                 torch.zeros(1))


def test_a_node_with_its_own_data_trains_on_all_of_it(tiny_recipe, tmp_path, flower_identity):
    import json

    own = tmp_path / "own.jsonl"
    own.write_text("".join(json.dumps({"question": f"What is {a} + 2?", "answer": f"{a} + 2 = {a + 2}\n#### {a + 2}"})
                           + "\n" for a in range(20)))
    configs = nodes(tmp_path, 2)
    configs[1]["data-path"] = str(own)
    grid = LoopbackGrid(configs)
    raw = tiny_recipe(federation={"num_clients": 2, "clients_per_round": 2, "rounds": 1})
    result = run(parse_recipe({**raw, "output_dir": str(tmp_path / "flower")}), executor=FlowerExecutor(grid))
    sizes = {int(m.content.metric_records["metrics"]["client_id"]): int(m.content.metric_records["metrics"]
                                                                            ["num_examples"])
             for m in grid.replies if "metrics" in m.content.metric_records and m.metadata.message_type == "train"}
    assert sizes[1] == 20  # all of the node's own file
    assert sizes[0] == 24  # client 0: its half (iid) of the recipe's 48 examples
    assert result.history[-1]["clients"] == [0, 1]


def test_flowers_own_strategy_loop_drives_the_adapter(tiny_recipe, tmp_path, flower_identity):
    """``FedllmStrategy`` is a plain Flower strategy: Flower's ``Strategy.start`` runs it to the simulation's model."""
    from flwr.app import ArrayRecord

    from fedllm.engine.server import RoundLoop, build_federation

    raw = tiny_recipe(federation={"num_clients": 3, "clients_per_round": 2, "rounds": 2, "strategy": "frlora"})
    sim = parts(run(parse_recipe({**raw, "output_dir": str(tmp_path / "sim")})).run_dir)
    grid = LoopbackGrid(nodes(tmp_path, 3))
    loop = RoundLoop(build_federation(parse_recipe({**raw, "output_dir": str(tmp_path / "flower")})),
                     tmp_path / "flower", executor=FlowerExecutor(grid))
    result = loop.executor.bind(loop).start(grid, ArrayRecord(), num_rounds=2)
    assert_close(sim["adapter"], records.decode(result.arrays), "global adapter")
    assert result.train_metrics_clientapp[2]["train_loss"] > 0


class WorkerGrid(LoopbackGrid):
    """A loopback grid whose nodes are fedllm node workers: each node answers from its own warm cache."""

    def __init__(self, node_configs):
        from fedllm.flower.worker_cache import NodeCache

        super().__init__(node_configs)
        self.caches = {node: NodeCache() for node in self.nodes}

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for m in messages:
            cache = self.caches[m.metadata.dst_node_id]
            with cache.serving():
                replies += super().send_and_receive([m], timeout=timeout)
            cache.build_prepared()  # as the worker does after handing back a reply (the query announces the run)
        return replies


@pytest.mark.parametrize("strategy", ["fedavg", "frlora", "scaffold", "pflmf"])
def test_worker_keeps_the_federation_warm_and_matches_the_simulation(strategy, tiny_recipe, tmp_path,
                                                                      flower_identity):
    """The node worker builds each node's federation once per run and reuses it for every message, starting
    each from what a freshly built node would hold: the final model equals the simulation's (<= 1e-6)."""
    fed = {"num_clients": 3, "clients_per_round": 2, "rounds": 3, "strategy": strategy}
    raw = tiny_recipe(federation=fed, train={"optimizer_state": "per_client"} if strategy == "frlora" else {})
    sim = parts(run(parse_recipe({**raw, "output_dir": str(tmp_path / "sim")})).run_dir)
    grid = WorkerGrid(nodes(tmp_path, 3))
    flower = parts(run(parse_recipe({**raw, "output_dir": str(tmp_path / "flower")}),
                       executor=FlowerExecutor(grid)).run_dir)
    assert_close(sim["adapter"], flower["adapter"], "global adapter")
    if "base" in sim:
        assert_close(sim["base"], flower["base"], "server base")
    for cid in range(3):
        sim_entry = {k.split("/", 1)[1]: v for k, v in sim.get("clients", {}).items() if k.startswith(f"client{cid}/")}
        node_entry = {k.split("/", 1)[1]: v for k, v in node_state(tmp_path, cid).get("clients", {}).items()}
        assert_close(sim_entry, node_entry, f"per-client state of client {cid}")
    assert [c.built for c in grid.caches.values()] == [1, 1, 1]  # one federation build per node for the run,
    assert not any(c.prepared for c in grid.caches.values())  # made when the query announced it


def test_a_node_that_lost_its_state_fails_loudly(tiny_recipe, tmp_path, flower_identity):
    """A node whose state directory is deleted mid-run fails its client (round line and summary.json say why)
    instead of training from a blank state; ``dropped`` names real client ids."""
    import json
    import shutil

    from flwr.app import Message
    from flwr.app.error import Error

    class ErrorReplyGrid(LoopbackGrid):  # as Flower's runtime does: a ClientApp that raises sends an error reply
        def send_and_receive(self, messages, *, timeout=None):
            replies = []
            for m in messages:
                try:
                    replies += super().send_and_receive([m], timeout=timeout)
                except Exception as e:  # noqa: BLE001
                    replies.append(Message(Error(code=0, reason=f"{type(e)}:<'{e}'>"), reply_to=m))
            return replies

    raw = tiny_recipe(federation={"num_clients": 2, "clients_per_round": 2, "rounds": 2, "strategy": "scaffold",
                                  "min_clients_per_round": 1})
    grid = ErrorReplyGrid(nodes(tmp_path, 2))
    executor = FlowerExecutor(grid)
    original = executor.train

    def train(loop, rnd, sampled, lr, bar):
        if rnd == 2:
            shutil.rmtree(tmp_path / "node1")  # client 1's machine lost its disk between the rounds
        return original(loop, rnd, sampled, lr, bar)

    executor.train = train
    result = run(parse_recipe({**raw, "output_dir": str(tmp_path / "flower")}), executor=executor)
    last = result.history[-1]
    assert list(last["dropped"]) == ["1"] and "state lost" in last["dropped"]["1"]
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert "state lost" in summary["dropped"]["2"]["1"]


def test_flower_security_second_node_claiming_a_client_is_refused(tiny_recipe, tmp_path, flower_identity):
    """Without node keys, the first node to claim a client id serves it; a second claimant is refused (and
    never asked again) without stopping the run."""
    configs = nodes(tmp_path, 2) + [{"partition-id": 0, "state-dir": str(tmp_path / "intruder")}]
    grid = LoopbackGrid(configs)
    executor = FlowerExecutor(grid)
    raw = tiny_recipe(federation={"num_clients": 2, "clients_per_round": 2, "rounds": 2})
    result = run(parse_recipe({**raw, "output_dir": str(tmp_path / "flower")}), executor=executor)
    assert executor.adapter.nodes == {0: 100, 1: 101} and executor.refused == {102}
    assert [h["clients"] for h in result.history] == [[0, 1], [0, 1]]
    assert not (tmp_path / "intruder").exists()  # the intruder's node never trained


class FakeClock:
    """``time`` for :mod:`fedllm.flower.executor`: ``sleep`` and a node's slow answer move it, nothing else."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def busy_federation(monkeypatch, claims, answers_within):
    """A FlowerExecutor (wait_nodes 10 s, round timeout 600 s) whose connected nodes ``claims`` (node -> client)
    answer a claim query only when it is given ``answers_within`` seconds or more; a shorter query costs its
    whole timeout on the fake clock (they are busy: serving another run, on a loaded machine)."""
    import fedllm.flower.executor as executor_module

    clock = FakeClock()
    monkeypatch.setattr(executor_module, "time", clock)
    executor = FlowerExecutor(grid=None, timeout=600.0, wait_nodes=10.0)
    monkeypatch.setattr(executor, "connected", lambda: {node: b"" for node in claims})

    def ask(nodes, timeout):
        if timeout < answers_within:
            clock.now += timeout
            return {}
        return {node: claims[node] for node in nodes if node in claims}

    monkeypatch.setattr(executor, "ask", ask)
    return executor


def test_a_connected_node_that_answers_after_the_wait_is_not_a_missing_node(monkeypatch, capsys):
    """The wait bounds the connecting, not a busy node's answer: 2 nodes that answer only when given a minute
    still count, and the run fails naming the one client no node serves (it said 0 of 3 before)."""
    from fedllm.flower.executor import FederationIncomplete

    executor = busy_federation(monkeypatch, {11: 0, 12: 1}, answers_within=60.0)
    with pytest.raises(FederationIncomplete, match=r"2 SuperNode\(s\) connected, 2 of 3 clients served "
                                                   r"\(missing: \[2\]\).* after 10s"):
        executor.discover(3)
    said = capsys.readouterr().out  # while it waited: what it had, before the nodes answered
    assert said.startswith("fedllm: waiting ") and "2 SuperNode(s) connected, 0 of 3 clients served" in said


def test_busy_nodes_that_answer_at_the_end_of_the_wait_make_the_federation(monkeypatch):
    executor = busy_federation(monkeypatch, {11: 0, 12: 1, 13: 2}, answers_within=60.0)
    assert executor.discover(3) == {0: 11, 1: 12, 2: 13}


def test_a_connected_node_that_never_answers_is_reported_missing(monkeypatch):
    from fedllm.flower.executor import FederationIncomplete

    executor = busy_federation(monkeypatch, {11: 0, 12: 1, 13: 2}, answers_within=60.0)
    answered = executor.ask
    monkeypatch.setattr(executor, "ask", lambda nodes, timeout: {n: c for n, c in answered(nodes, timeout).items()
                                                                  if n != 13})
    with pytest.raises(FederationIncomplete, match=r"3 SuperNode\(s\) connected, 2 of 3 clients served "
                                                   r"\(missing: \[2\]\)"):
        executor.discover(3)


def test_flower_sync_folder_keeps_only_what_a_late_node_or_a_resume_still_needs(tiny_recipe, tmp_path, flower_identity,
                                                                                 monkeypatch):
    """FRLoRA's server keeps each round's aggregate for the nodes that missed it (``flower/sync``); at each checkpoint
    it deletes those every node had applied by the checkpoint before (``prune_aggregates``). Over 4 rounds with 2 of 3
    clients a round: after every checkpoint, the folder holds every round some client has not applied at the previous
    checkpoint (what a late node or a resume from that checkpoint needs), and nothing older."""
    fed = {"num_clients": 3, "clients_per_round": 2, "rounds": 4, "strategy": "frlora"}
    recipe = parse_recipe({**tiny_recipe(federation=fed), "output_dir": str(tmp_path / "flower"),
                           "checkpoint": {"every": 1}})
    seen, original = [], FlowerExecutor.state

    def state(self):
        previous = dict(self.checkpointed)
        out = original(self)
        folder = self.adapter.sync_dir
        kept = sorted(int(p.stem.split("-")[1]) for p in folder.glob("round-*.safetensors"))
        seen.append((previous, kept, sum(p.stat().st_size for p in folder.iterdir())))
        return out

    monkeypatch.setattr(FlowerExecutor, "state", state)
    run(recipe, executor=FlowerExecutor(LoopbackGrid(nodes(tmp_path, 3))))
    assert len(seen) == 4
    for t, (previous, kept, _) in enumerate(seen, start=1):  # the checkpoint after round t
        oldest_needed = min(previous.values()) + 1 if len(previous) == 3 else 1
        assert kept == list(range(oldest_needed, t + 1)), (t, previous, kept)
    assert seen[-1][1] == [2, 3, 4]  # pruned: not every round's aggregate stays
    print("sync folder after each checkpoint (rounds kept, bytes):", [(kept, size) for _, kept, size in seen])
