"""The Flower ClientApp: one fedllm client per SuperNode (``--node-config "partition-id=K state-dir='DIR'"``).

Messages it answers (all built by :class:`fedllm.flower.adapter.FedllmStrategy`):

- ``query.fedllm``: which client this node is (and an echo of an optional transport probe);
- ``train``: catch up on missed rounds, train through :func:`fedllm.engine.client.run_client`, reply with the upload;
- ``train.sync``: catch up only (after the last round, so every node ends with the server's model);
- ``query.secagg``: a SecAgg+ stage (:mod:`fedllm.flower.secagg_stages`; a SecAgg+ ``train`` answers masked words).

The per-client state stays in the node's state directory (:mod:`fedllm.flower.node`). Under Flower's own
per-message process (plain ``flower-supernode``) each message builds the node afresh; inside fedllm's node
worker (``fedllm flower supernode``, :mod:`fedllm.flower.runtime`) the built node is reused. Heavy imports
(torch, transformers) happen inside the handlers, so a ``query`` answers in a fraction of a second.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.query("fedllm")
def info(msg: Message, context: Context) -> Message:
    """Tell the server which client this node serves; echo the size and sum of a transport probe. A node worker
    starts building the run's federation now (the query announces the run), so the node's first train message
    finds it built."""
    from fedllm.flower.node import NodeConfig
    from fedllm.flower.worker_cache import prepare_node

    node = NodeConfig.parse(dict(context.node_config))
    cfg = msg.content.config_records.get("fedllm")
    if cfg is not None and cfg.get("recipe"):
        prepare_node(node, str(cfg["recipe"]), str(cfg["token"]))
    reply = {"client_id": node.client_id, "probe_bytes": 0, "probe_sum": 0.0}
    if "probe" in msg.content.array_records:
        arrays = msg.content.array_records["probe"]
        tensors = [a.numpy() for a in arrays.values()]
        reply["probe_bytes"] = sum(t.nbytes for t in tensors)
        reply["probe_sum"] = float(sum(t.astype("float64").sum() for t in tensors))
    return Message(RecordDict({"info": MetricRecord(reply)}), reply_to=msg)


def _open_node(msg: Message, context: Context):
    from fedllm.flower import records
    from fedllm.flower.node import NodeConfig
    from fedllm.flower.worker_cache import open_node

    cfg = msg.content.config_records["fedllm"]
    node = open_node(NodeConfig.parse(dict(context.node_config)), str(cfg["recipe"]), str(cfg["token"]))
    node.use_threads()
    node.load(before=int(cfg["round"]), expected_step=int(cfg.get("step_from", 0)))
    rounds = {int(name.split(".", 1)[1]): records.decode(rec)
              for name, rec in msg.content.array_records.items() if name.startswith("sync.")}
    node.catch_up(int(cfg["synced_from"]), rounds)
    return node, cfg


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Catch up, train this node's client for the round, keep its state here, send its upload."""
    import json

    from fedllm.flower import records
    from fedllm.privacy import client_stats

    secure = "secagg" in msg.content.config_records  # SecAgg+: only the masked change goes back
    if secure:
        from fedllm.flower import secagg_stages
        from fedllm.flower.node import NodeConfig

        secagg_stages.check_secrets(msg, NodeConfig.parse(dict(context.node_config)).client_id)
    node, cfg = _open_node(msg, context)
    content = msg.content.array_records
    state = records.decode(content["plan"])
    if "plan.packed" in content:  # a compressed download (federation.compression.download)
        from fedllm.models.compression import read_packed

        state = read_packed(records.decode_packed(content["plan.packed"], str(cfg["packed"])), state, {})
    extra = records.join_extra(records.decode(content["extra"]) if "extra" in content else {},
                               str(cfg["extra"]))
    local = records.decode(content["local"]) if "local" in content else {}
    update = node.train(int(cfg["round"]), float(cfg["lr"]), state, json.loads(str(cfg["phases"])), extra, local)
    if secure:
        update = secagg_stages.masked_update(msg, node, update, state)
    node.save(int(cfg["round"]), state)
    if client_stats.withheld(node.recipe):  # SecAgg+ / client-level DP: no loss or token counts in the reply
        update = client_stats.withhold(update)
    comm = node.recipe.federation.comm_dtype
    loss = {} if update.loss is None else {"loss": float(update.loss)}  # DP-SGD uploads no loss
    reply = RecordDict()
    packed = {}
    if update.packed is not None:  # a compressed upload travels as its codes and block absmax
        packed_record, layout = records.encode_packed(update.packed)
        packed = {"packed": layout}
        reply["update.packed"] = packed_record
    metrics = MetricRecord({"client_id": node.config.client_id, "num_examples": update.num_examples, **loss,
                            "steps": update.steps, "synced": node.synced, "step": int(cfg["round"]),
                            **{f"work.{k}": v for k, v in update.work.items()}})  # tokens, seconds (throughput)
    reply["update"] = records.encode({k: v for k, v in update.state.items() if k not in (update.packed or {})}, comm)
    reply["metrics"] = metrics
    if packed:
        reply["fedllm"] = ConfigRecord(packed)
    return Message(reply, reply_to=msg)


@app.query("secagg")
def secagg(msg: Message, context: Context) -> Message:
    """A SecAgg+ stage (key advertisement, share exchange, unmasking: :mod:`fedllm.flower.secagg_stages`)."""
    from fedllm.flower.secagg_stages import answer_stage

    return answer_stage(msg, context)


@app.train("sync")
def sync(msg: Message, context: Context) -> Message:
    """Apply the rounds this node missed and keep the result (no training)."""
    from fedllm.models.loading import read_state

    node, _ = _open_node(msg, context)
    node.save(node.synced, read_state(node.fed.loaded.model, node.fed.global_keys))
    return Message(RecordDict({"metrics": MetricRecord({"client_id": node.config.client_id, "synced": node.synced,
                                                        "step": node.synced})}), reply_to=msg)

