"""A run's start does not wait for a SuperNode that died without signing off (fedllm.flower.executor's discovery; a
scripted grid, no Flower process). Seen on the shared test deployment at load 12-17: a node of the security module,
killed 10 s after its SIGTERM, was still counted online when the next module's run asked its nodes which client they
serve; its query came back "Node Unavailable" and the start waited node_wait (300 s) for it to come back."""

from types import SimpleNamespace

import pytest

pytest.importorskip("flwr")

from flwr.common.constant import ErrorCode

from fedllm.flower.executor import FederationIncomplete, FlowerExecutor


class DeadNodeGrid:
    """Node 1 serves client 0; node 2 died: listed online until its first query comes back "Node Unavailable"."""

    def __init__(self):
        self.online, self.sent, self.pulls = [1, 2], {}, 0

    def get_nodes(self):
        return [SimpleNamespace(node_id=n, public_key=b"") for n in self.online]

    def push_messages(self, messages):
        ids = [f"q{len(self.sent) + i}" for i in range(len(messages))]
        self.sent.update({i: m.metadata.dst_node_id for i, m in zip(ids, messages)})
        return ids

    def pull_messages(self, ids):
        self.pulls += 1
        assert self.pulls < 50, "the start waits for a node that is gone"
        replies = []
        for i in sorted(ids):
            node = self.sent[i]
            meta = SimpleNamespace(reply_to_message_id=i, src_node_id=node)
            if node == 2:  # as the SuperLink answers once the node's heartbeats have timed out
                self.online = [1]
                replies.append(SimpleNamespace(metadata=meta, has_error=lambda: True, error=SimpleNamespace(
                    code=ErrorCode.NODE_UNAVAILABLE, reason="Error: Node Unavailable")))
            else:
                info = {"client_id": 0, "probe_bytes": 0, "probe_sum": 0.0}
                replies.append(SimpleNamespace(metadata=meta, has_error=lambda: False,
                                               content=SimpleNamespace(metric_records={"info": info})))
        return replies


def test_a_node_gone_offline_does_not_hold_the_start_and_is_not_counted(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for field in ("_run_id", "_node_id", "_task_id"):  # as inside a ServerApp task (tests/test_flower_apps.py)
        monkeypatch.setattr(TaskIdentity, field, 1)
    grid = DeadNodeGrid()
    executor = FlowerExecutor(grid, wait_nodes=0.0, node_wait=300.0, sleep=lambda s: None)
    executor.token, executor.recipe_yaml = "run", "{}"
    with pytest.raises(FederationIncomplete, match=r"1 SuperNode\(s\) connected, 1 of 2 clients served \(missing: "
                                                   r"\[1\]\)"):
        executor.discover(2)
