"""fedllm's own task runners for Flower's ``--isolation process``: only fedllm's apps run, and they stay warm.

Flower's SuperLink and SuperNode hand every run's work out as *tasks* over their local Runtime API; with
``--isolation process`` they start nothing themselves and wait for an outside process to claim the tasks
(``AcquireTask``, authenticated with the HMAC secret of ``--superexec-auth-secret-file``). fedllm claims
them with the two runners here instead of Flower's ``flower-superexec``:

- :func:`serve_serverapps` (beside ``flower-superlink``, started by ``fedllm flower superlink``): each
  ServerApp task runs in a child forked from the runner (:func:`run_server_task`) that executes fedllm's installed
  :mod:`fedllm.flower.server_app` — never code from the submitted FAB — and refuses any FAB that is not
  fedllm's app, which then fails with that reason on the SuperLink (``flwr ls``/``flwr log``). A child that dies
  before reporting its run's outcome (killed, out of memory) has its run ended as failed at once
  (:func:`fail_dead_task`).
- :func:`serve_clientapps` (the node *worker*, beside ``flower-supernode``, started by
  ``fedllm flower supernode``): one long-lived process answering the node's ClientApp tasks with fedllm's
  installed :mod:`fedllm.flower.client_app` and keeping each run's federation (model, data, strategy) in
  memory between messages (:mod:`fedllm.flower.worker_cache`); the node's state is still written to
  ``--state-dir`` after every message, so a worker that is killed restarts from it, forked again from a parent
  that holds the imports (:mod:`fedllm.flower.worker_restart`).

Both Runtime APIs listen on 127.0.0.1 only; the secret (a file readable only by its owner) keeps other
local users from claiming tasks.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path

APP_ID = "fedllm/fedllm-flower"
"""``publisher/name`` of fedllm's Flower app (``app/pyproject.toml``); any other FAB is refused."""
ACQUIRE = "/flwr.proto.Runtime/AcquireTask"

log = logging.getLogger("fedllm")


def write_secret(path: Path) -> Path:
    """A fresh 32-byte secret in ``path`` (mode 0600), for ``--superexec-auth-secret-file``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_bytes(secrets.token_bytes(32))
    return path


def fab_refusal(fab_content: bytes) -> str | None:
    """Why a FAB may not run here (None: it is fedllm's app). Its code is never run either way."""
    from flwr.cli.config_utils import get_fab_metadata

    try:
        fab_id, _ = get_fab_metadata(fab_content)
    except Exception as e:  # noqa: BLE001 — an unreadable FAB is refused, whatever the reason
        return f"unreadable app bundle ({e}); this federation runs only fedllm's app ({APP_ID})"
    if fab_id != APP_ID:
        return f"app {fab_id!r} refused: this federation runs only fedllm's app ({APP_ID})"
    return None


def _input_error(e: BaseException | None) -> bool:
    """True when ``e`` or an exception it was raised from is fedllm's :class:`~fedllm.common.errors.InputError`."""
    from fedllm.common.errors import InputError

    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, InputError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def shown_in_run_log(e: BaseException) -> str:
    """What the run's log (``flwr log``, readable through the SuperLink's Control API) may say of bad input ``e``.

    Messages fedllm writes from the run config alone (a refused signature, a taken or forbidden ``output_dir``) in
    full; a recipe's problems by their keys only, and any other input error by its kind only: their values may
    quote files on the SuperLink's machine (a data file's fields, a folder's listing), and those stay on the
    SuperLink's terminal (``fedllm flower superlink``), where the full message is printed.
    """
    from fedllm.flower.authorise import RunRefused
    from fedllm.recipe.schema import RecipeError
    from fedllm.runs.rundir import RunDirError

    while e is not None and not isinstance(e, (RunRefused, RunDirError, RecipeError)) and e.__cause__ is not None:
        e = e.__cause__
    if isinstance(e, (RunRefused, RunDirError)):
        return str(e)
    where = "its values and what is expected are on the SuperLink's terminal (fedllm flower superlink)"
    if isinstance(e, RecipeError):
        keys = ", ".join(dict.fromkeys(str(key) for key, _, _ in e.problems))
        return f"{e.source}: {len(e.problems)} problem(s) in the recipe, at {keys}; {where}"
    return f"the SuperLink refused the run's input ({type(e).__name__}); its message is on the SuperLink's terminal " \
           "(fedllm flower superlink)"


def _certificates(root_certificates: str | None) -> bytes | None:
    return Path(root_certificates).read_bytes() if root_certificates else None


def claim_loop(address: str, secret: bytes, task_type: str, handle: Callable[[str, object], None],
               root_certificates: str | None = None, poll_s: float = 0.05,
               idle: Callable[[], None] | None = None, wait: Callable[[float], object] = time.sleep) -> None:
    """Claim ``task_type`` tasks from the Runtime API at ``address`` forever; ``handle(token, task)`` each one
    (``task``: Flower's ``Task`` message; ``idle()`` whenever there is none, then ``wait(poll_s)``: a sleep, or a wait
    for a wake)."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor
    from flwr.supercore.runtime import RuntimeHttpClient

    client = RuntimeHttpClient.from_server_address(
        server_address=address, insecure=root_certificates is None, root_certificates=_certificates(root_certificates),
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec"),
                      SuperExecAuthHttpInterceptor(master_secret=secret, protected_methods={ACQUIRE})])
    while True:
        try:
            res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[task_type]))
        except Exception as e:  # noqa: BLE001 — the API is not up yet, or restarting
            log.debug("AcquireTask at %s: %s", address, e)
            time.sleep(1.0)
            continue
        if res.HasField("task") and res.token:
            handle(res.token, res.task)
        else:
            if idle is not None:
                idle()
            wait(poll_s)


# ----- the SuperLink side
SERVER_APP_IMPORTS = ("flwr.server.run_serverapp", "flwr.superlink.grid", "fedllm.flower.server_app",
                      "fedllm.flower.executor", "fedllm.engine.server", "fedllm.models.loading", "peft")
"""What every ServerApp task imports (torch, transformers and peft among them): imported once by the runner as it
starts (while the SuperLink starts, registers node keys and the nodes join), so that each task's forked child starts
with them and a run's task starts as soon as it is claimed. Imported after the claim instead (before), they held the
first run back by their ~9 CPU-seconds, and past 30 s on a loaded machine Flower took the claimed task back (a claim
not started within one heartbeat interval is pending again) and the first child was refused (401)."""


def serve_serverapps(address: str, secret: bytes, root_certificates: str | None, node_keys: str | None,
                     operator=None, poll_s: float = 1.0) -> None:
    """Claim every ServerApp task of the SuperLink at ``address``; run each in a child forked from this runner.

    Every ``poll_s`` (runs start seldom: a claim every second costs little) it also collects the children that ended;
    one that ended without reporting its run's outcome (killed, out of memory, a crash) has its task reported failed
    (:func:`fail_dead_task`), which ends its run on the SuperLink at once.

    The runner imports the ServerApp's modules once (:data:`SERVER_APP_IMPORTS`) and runs no torch operation and no
    other thread itself, so each child starts without paying those imports again (about 9 CPU-seconds a run on a
    2-core machine); a child that crashes takes only its own run down.
    """
    import importlib

    from flwr.supercore.constant import TaskType

    from fedllm.flower import processes

    children: dict[str, tuple[processes.Forked, int]] = {}  # by task token: the child and its run

    def reap() -> None:  # a finished child is collected at once, not left <defunct> until the next run
        for token, (child, run_id) in list(children.items()):
            if child.poll() is not None:
                del children[token]
                if child.returncode != 0:  # 0: it reported its run's outcome; otherwise it died before
                    fail_dead_task(address, token, root_certificates, run_id, child.returncode)

    def launch(token: str, task) -> None:
        reap()
        children[token] = (processes.Forked(lambda: run_server_task(address, token, root_certificates, node_keys,
                                                                    operator)), task.run_id)

    for name in SERVER_APP_IMPORTS:  # before the first claim: a claim not started within 30 s is taken back
        importlib.import_module(name)
    try:
        claim_loop(address, secret, TaskType.SERVER_APP, launch, root_certificates, poll_s=poll_s, idle=reap)
    finally:
        for child, _ in children.values():
            processes.stop(child)


def exit_cause(returncode: int) -> str:
    """``returncode`` of a child (negative: the signal that ended it) in words: "killed by SIGKILL", "exit code 1"."""
    import signal

    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def fail_dead_task(address: str, token: str, root_certificates: str | None, run_id: int, returncode: int) -> bool:
    """Report the ServerApp task ``token`` (of run ``run_id``) whose child ended with ``returncode`` as failed on the
    SuperLink at ``address``, in case the child died before reporting it itself (killed, out of memory, a crash); True
    when the SuperLink took the report (the run is then finished:failed, and one line on stderr says so).

    Without it the run stays "running" until Flower ends the task for missing heartbeats (minutes under fedllm's
    :data:`~fedllm.flower.task_patience.PATIENCE`), and a node pulling one of the run's messages keeps asking for
    objects nobody will push. Reported, every pull of the run is refused at once (Flower's ``check_abort``). A task
    the child finished itself (a run that completed, or failed and said so) has its token revoked by then: the
    SuperLink refuses this report, and nothing is touched.
    """
    import httpx
    from flwr.common.constant import SubStatus
    from flwr.proto.runtime_pb2 import PushTaskOutputRequest  # pylint: disable=E0611
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supercore.runtime import RuntimeHttpClient

    cause = exit_cause(returncode)
    client = RuntimeHttpClient.from_server_address(
        server_address=address, insecure=root_certificates is None, root_certificates=_certificates(root_certificates),
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-serverapp"),
                      RuntimeTokenHttpInterceptor(token)])
    try:
        client.PushTaskOutput(PushTaskOutputRequest(sub_status=SubStatus.FAILED,
                                                    details=f"ServerApp process {cause} (fedllm's ServerApp runner)"))
    except (httpx.HTTPStatusError, httpx.TransportError) as e:  # 401: the child finished its task itself
        log.debug("ServerApp of run %s %s; its task is not open (%s): nothing reported", run_id, cause, e)
        return False
    finally:
        client.close()
    print(f"fedllm: the ServerApp of run {run_id} died ({cause}): run {run_id} stopped on the SuperLink "
          "(finished:failed); continue it with fedllm flower run ... --resume",
          file=sys.stderr, flush=True)
    return True


def run_server_task(address: str, token: str, root_certificates: str | None, node_keys: str | None,
                    operator=None) -> int:
    """One ServerApp task: pull its input, refuse a foreign FAB, run fedllm's ServerApp, report the outcome.

    Returns 0 once the outcome (completed or failed) has reached the SuperLink, 1 when it could not be reported: the
    runner then reports the task as failed itself (:func:`fail_dead_task`), as it does for a child that was killed.
    """
    from queue import Queue

    from flwr.common.config import get_fused_config_from_fab
    from flwr.common.constant import SubStatus
    from flwr.common.serde import context_from_proto, context_to_proto, fab_from_proto, run_from_proto
    from flwr.proto.runtime_pb2 import PullTaskInputRequest, PushTaskOutputRequest  # pylint: disable=E0611
    from flwr.server.run_serverapp import run as run_server_app
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supercore.logger import (
        flush_logs,
        mirror_output_to_queue,
        restore_output,
        start_log_uploader,
        stop_log_uploader,
    )
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.superlink.grid import HttpGrid

    from fedllm.flower import server_app

    log_queue: Queue = Queue()
    mirror_output_to_queue(log_queue)
    grid = HttpGrid(runtime_api_address=address, insecure=root_certificates is None,
                    root_certificates=_certificates(root_certificates), token=token)
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(grid._runtime_client))
    heartbeat.start()
    uploader, context, reported = None, None, False
    status, details = SubStatus.FAILED, "ServerApp task failed"
    try:
        res = grid._runtime_client.PullTaskInput(PullTaskInputRequest())
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = (res.task_id, res.run.run_id,
                                                                            res.context.node_id)
        context, run, fab = context_from_proto(res.context), run_from_proto(res.run), fab_from_proto(res.fab)
        grid.set_run(run)
        uploader = start_log_uploader(log_queue=log_queue, node_id=0, run_id=run.run_id, client=grid._runtime_client)
        refusal = fab_refusal(fab.content)
        if refusal:
            print(f"fedllm: {refusal}", file=sys.stderr, flush=True)
            details = refusal
        else:
            context.run_config = get_fused_config_from_fab(fab.content, run)
            from flwr.superlink.grid import http_grid

            from fedllm.flower.supernode import quick_object_pulls

            quick_object_pulls(http_grid)  # a reply's chunks: asked again after 50 ms, not Flower's 1 s
            server_app.NODE_KEYS, server_app.OPERATOR = node_keys, operator
            run_server_app(grid=grid, context=context, server_app_dir="", loaded_server_app=server_app.app)
            status, details = SubStatus.COMPLETED, ""
    except Exception as e:  # noqa: BLE001 — reported to the SuperLink as the run's failure
        from fedllm.flower import BAD_INPUT, FEDERATION_INCOMPLETE

        told = str(e)
        if FEDERATION_INCOMPLETE in told:  # an expected condition: its message says it all
            print(f"fedllm: {e}", file=sys.stderr, flush=True)
        elif _input_error(e):  # bad input (a taken output_dir, a recipe the strategy refuses): the message, as the
            told = shown_in_run_log(e)  # CLI gives it, not a traceback; what may quote files: on this terminal only
            if told != str(e):
                os.write(2, f"fedllm: error in run {context.run_id if context else '?'}: {e}\n".encode())
            print(f"fedllm: error: {told}", file=sys.stderr, flush=True)
        else:
            logging.getLogger("fedllm").exception("ServerApp raised")
        details = f"ServerApp failed with exception{f' ({BAD_INPUT})' if _input_error(e) else ''}: {told}"
    finally:
        if uploader is not None:
            flush_logs(log_queue)
        try:
            grid._runtime_client.PushTaskOutput(PushTaskOutputRequest(
                context=context_to_proto(context) if context else None, sub_status=status, details=details))
            reported = True
        except Exception as e:  # noqa: BLE001
            print(f"fedllm: could not report the task's outcome: {e}", file=sys.stderr)
        if uploader is not None:
            stop_log_uploader(log_queue, uploader)
        heartbeat.stop()
        grid.close()
        restore_output()
    return 0 if reported else 1


# ----- the SuperNode side: the worker
def serve_clientapps(address: str, secret: bytes, journal: Path | None = None, poll_s: float = 0.25,
                     warm_runs: int = 2) -> None:
    """The node worker: claim every ClientApp task of the SuperNode at ``address`` and answer it in process.

    ``journal``: where the message being answered is kept until its reply is pushed; a worker that starts and
    finds one (its predecessor was killed mid-message) answers that message first, under the same task token.
    While idle the worker waits for its SuperNode's wake (:mod:`fedllm.flower.wake`), claiming every
    :data:`~fedllm.flower.wake.FALLBACK_S` regardless; where it cannot listen, it claims every ``poll_s``.
    """
    from flwr.supercore.constant import TaskType

    from fedllm.flower import wake
    from fedllm.flower.worker_cache import NodeCache

    from fedllm.models import kept_bases

    kept_bases.keep()  # a later run of the same model copies its base from memory instead of loading it again
    cache = NodeCache(warm_runs)
    if journal is not None and journal.is_file():
        replay_journal(address, cache, journal)
    wakeup = wake.Wakeup(secret)
    claim_loop(address, secret, TaskType.CLIENT_APP, lambda token, _: run_client_task(address, token, cache, journal),
               poll_s=poll_s if wakeup.sock is None else wake.FALLBACK_S, idle=import_ahead, wait=wakeup.wait)


WORKER_IMPORTS = ("fedllm.engine.server", "fedllm.engine.client", "fedllm.runs.checkpoint", "fedllm.flower.records",
                  "fedllm.flower.node", "fedllm.flower.client_app", "flwr.supernode.runtime.run_clientapp",
                  "flwr.supercore.heartbeat")
"""What answering a message imports (torch, transformers and peft among them, ~12 CPU-seconds on a 2-core EPYC):
imported once by the worker's parent before it forks the worker (:mod:`fedllm.flower.worker_restart`), so that
neither a run's first round nor a worker restarted after a crash waits for them."""


def import_ahead() -> None:
    """Import :data:`WORKER_IMPORTS` (once: later calls find them imported)."""
    import importlib

    for name in WORKER_IMPORTS:
        if name not in sys.modules:
            importlib.import_module(name)


def task_alive(address: str, token: str, wait_s: float = 10.0) -> bool:
    """Whether the SuperNode at ``address`` still holds task ``token``: a task heartbeat under it succeeds. A
    SuperNode not answering yet (starting beside this worker) is asked again for up to ``wait_s``."""
    import httpx
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest  # pylint: disable=E0611
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supercore.runtime import RuntimeHttpClient

    client = RuntimeHttpClient.from_server_address(
        server_address=address, insecure=True, root_certificates=None,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                      RuntimeTokenHttpInterceptor(token)])
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                return bool(client.SendTaskHeartbeat(SendTaskHeartbeatRequest()).success)
            except httpx.HTTPStatusError as e:  # 401/403: a token this SuperNode does not know (any more)
                if e.response.status_code not in (503, 504) or time.monotonic() > deadline:
                    return False
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    return False
            time.sleep(0.2)
    finally:
        client.close()


def replay_journal(address: str, cache, journal: Path) -> bool:
    """Answer the message a killed worker left in ``journal`` under its task's token, if the SuperNode still holds that
    task; otherwise discard the journal, saying why (True: answered). The SuperNode forgets its tasks when it restarts
    (its state is in memory) and a task expires 60 s after its last heartbeat: answering then would train for nothing
    and be refused (401); Flower reports the message as failed, and the server drops this client from that round."""
    try:
        token, pulled = read_journal(journal)
    except Exception as e:  # noqa: BLE001 — a journal that cannot be read cannot be answered either
        log.warning("discarding %s: unreadable (%s)", journal, e)
        journal.unlink(missing_ok=True)
        return False
    message_id = pulled[0].metadata.message_id
    if not task_alive(address, token):
        log.warning("discarding the interrupted message %s: the SuperNode no longer holds its task (the SuperNode "
                    "restarted, or the task expired 60 s after its last heartbeat); the server drops this client from "
                    "that round", message_id)
        journal.unlink(missing_ok=True)
        return False
    log.warning("answering message %s, interrupted when the previous worker stopped", message_id)
    try:
        run_client_task(address, token, cache, journal, pulled)
    except Exception as e:  # noqa: BLE001 — e.g. the task expired meanwhile: Flower reports the crash
        log.error("could not answer the interrupted message: %s", e)
        journal.unlink(missing_ok=True)
        return False
    return True


def write_journal(path: Path, token: str, message, context) -> None:
    """Keep ``message`` (with its content) and ``context`` of task ``token`` in ``path`` (atomically, mode 0600)."""
    import json
    import os

    from flwr.common.serde import context_to_proto, message_to_proto

    tmp = path.with_name(path.name + ".tmp")
    tmp.touch(mode=0o600)
    with open(tmp, "wb") as f:
        for blob in (json.dumps({"token": token, "message_id": message.metadata.message_id}).encode(),
                     message_to_proto(message).SerializeToString(), context_to_proto(context).SerializeToString()):
            f.write(len(blob).to_bytes(8, "little") + blob)
    os.replace(tmp, path)


def read_journal(path: Path):
    """``(token, (message, context))`` from :func:`write_journal`'s file."""
    import json

    from flwr.common.serde import context_from_proto, message_from_proto
    from flwr.proto.message_pb2 import Context as ProtoContext  # pylint: disable=E0611
    from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=E0611

    data, blobs = path.read_bytes(), []
    while data:
        size = int.from_bytes(data[:8], "little")
        blobs.append(data[8:8 + size])
        data = data[8 + size:]
    head = json.loads(blobs[0])
    message = message_from_proto(ProtoMessage.FromString(blobs[1]))
    message.metadata.__dict__["_message_id"] = head["message_id"]
    return head["token"], (message, context_from_proto(ProtoContext.FromString(blobs[2])))


def pull_task_input(client):
    """Flower's ``run_clientapp.pull_task_input``, retrying every 50 ms (capped at 0.5 s) instead of from 1 s (capped
    at 10 s): a warm worker claims a task before its SuperNode has finished receiving the message's objects."""
    from flwr.app import Message
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest  # pylint: disable=E0611
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = res.task_id, res.run.run_id, res.context.node_id
    context, run, fab = context_from_proto(res.context), run_from_proto(res.run), fab_from_proto(res.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, initial_backoff=0.05, backoff_cap=0.5)
    message.metadata.__dict__["_message_id"] = tree.object_id
    return message, context, run, fab


def run_client_task(address: str, token: str, cache, journal: Path | None = None, pulled=None) -> None:
    """One ClientApp task: pull the message (or take ``pulled``), answer it with fedllm's ClientApp (warm),
    push the reply."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

    from fedllm.flower import client_app

    client = RuntimeHttpClient.from_server_address(
        server_address=address, insecure=True, root_certificates=None,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                      RuntimeTokenHttpInterceptor(token)])
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message, context, reply = None, None, None
    status, details = SubStatus.FAILED, "ClientApp task failed"
    phases = [time.monotonic()]  # claimed, pulled, answered, handed back: the worker's log line per message
    try:
        if pulled is not None:
            message, context = pulled
            refusal = None
        else:
            message, context, _run, fab = pull_task_input(client)
            refusal = fab_refusal(fab.content)
        phases.append(time.monotonic())
        if refusal:
            log.error("%s", refusal)
            reply = Message(Error(code=ErrorCode.LOAD_CLIENT_APP_EXCEPTION, reason=refusal), reply_to=message)
            details = refusal
        else:
            if journal is not None and pulled is None:
                write_journal(journal, token, message, context)
            share_cores()
            with cache.serving():
                reply = client_app.app(message=message, context=context)
            status, details = SubStatus.COMPLETED, ""
            phases.append(time.monotonic())
    except Exception as e:  # noqa: BLE001 — the server sees the error reply and drops this client for the round
        log.exception("fedllm ClientApp raised")
        reason = f"{type(e)}:<'{e}'>"
        details = reason
        if message is not None:
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
            push_task_output(client=client, context=context, sub_status=status, details=details)
            if len(phases) == 3:
                log.info("fedllm worker: %s message: received in %.2f s, answered in %.2f s, handed back in %.2f s",
                         message.metadata.message_type, phases[1] - phases[0], phases[2] - phases[1],
                         time.monotonic() - phases[2])
        except Exception as e:  # noqa: BLE001 — the run was stopped (or the SuperNode restarted) meanwhile: the
            log.warning("could not hand back the reply to message %s (its run stopped, or the SuperNode restarted): "
                        "%s", message.metadata.message_id if message is not None else "?", e)  # worker goes on
        finally:
            if journal is not None:
                journal.unlink(missing_ok=True)
            heartbeat.stop()
            client.close()
            cache.build_prepared()  # a run the server's query just announced: built now, before its first message


def share_cores() -> None:
    """For a run that carries no thread count (a ServerApp of an older fedllm; fedllm's own sends the run's count,
    which the node then trains with: :meth:`fedllm.flower.node.Node.use_threads`), and with fedllm's automatic
    thread count: share the usable cores among the node workers of this machine
    (:func:`fedllm.flower.wake.local_workers`), as ``fedllm train`` shares them among the processes of a torchrun
    launch: two workers training at once with every core each oversubscribe the cores, and each one's OpenMP
    threads then wait at every barrier for a thread the other process holds off the core (measured: 25 % of the
    wall time computing). A thread count the user chose (``FEDLLM_THREADS``, ``OMP_NUM_THREADS``,
    ``train.threads``) is kept."""
    from fedllm.common import threads
    from fedllm.flower import wake

    policy = threads.chosen()
    if policy is None or policy.source != "auto" or "torch" not in sys.modules:
        return
    torch = sys.modules["torch"]
    wanted = max(1, policy.threads // wake.local_workers())
    if torch.get_num_threads() != wanted:
        log.info("fedllm worker: CPU threads %d (%d usable cores shared by the %d node workers on this machine)",
                 wanted, policy.threads, wake.local_workers())
        torch.set_num_threads(wanted)


def configure_logging() -> None:
    """INFO lines of fedllm's runners; third-party noise filtered as in the CLI's quiet mode (``fedllm flower run``
    streams the ServerApp's output to the user), unless ``FEDLLM_LOG=debug``."""
    from fedllm.common import logs

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if os.environ.get("FEDLLM_LOG", "").lower() != "debug":
        logs.quiet_third_party()


def apply_thread_policy(side: str) -> None:
    """fedllm's CPU thread policy (:mod:`fedllm.common.threads`), applied before torch loads, as ``fedllm train``
    applies it: the thread count (``FEDLLM_THREADS`` > a user's ``OMP_NUM_THREADS`` > the usable cores) and
    ``OMP_WAIT_POLICY=PASSIVE`` when the machine is busy. Every ServerApp forked from this runner and every message
    the worker answers inherit it; a recipe's ``train.threads`` then sets the count when its federation is built
    (the ServerApp: ``fedllm.engine.server.run``; the worker: :class:`fedllm.flower.node.Node`)."""
    from fedllm.common import threads

    policy = threads.apply()
    log.info("fedllm %s: CPU threads %d (%s); OpenMP wait: %s (%s)", "ServerApp runner" if side == "serverapps"
             else "worker", policy.threads, policy.source,
             " ".join(f"{k}={v}" for k, v in policy.wait.items()) or "default", policy.wait_source)


def main(argv: list[str] | None = None) -> None:
    """``python -m fedllm.flower.runtime serverapps|clientapps --runtime-api-address A --secret-file F``."""
    import argparse

    parser = argparse.ArgumentParser(description="fedllm's task runner for a Flower SuperLink or SuperNode")
    parser.add_argument("side", choices=["serverapps", "clientapps"])
    parser.add_argument("--runtime-api-address", required=True)
    parser.add_argument("--secret-file", required=True)
    parser.add_argument("--root-certificates")
    parser.add_argument("--node-keys")
    parser.add_argument("--operator-pub", help="only runs signed with this operator key run (serverapps)")
    parser.add_argument("--runs-dir", default=".", help="runs may write only inside it (serverapps)")
    parser.add_argument("--used-nonces", help="file of the signed run configs' nonces seen (serverapps)")
    parser.add_argument("--poll", type=float, default=0.25, help="seconds between task claims (clientapps)")
    parser.add_argument("--journal", help="file keeping the message being answered (clientapps)")
    parser.add_argument("--warm-runs", type=int, default=2, help="runs whose federation stays in memory (clientapps)")
    args = parser.parse_args(argv)
    configure_logging()
    apply_thread_policy(args.side)
    secret = Path(args.secret_file).read_bytes()
    if args.side == "serverapps":
        from fedllm.flower.server_app import Operator

        used = args.used_nonces or str(Path(args.secret_file).with_name("nonces"))
        serve_serverapps(args.runtime_api_address, secret, args.root_certificates, args.node_keys,
                         Operator(args.operator_pub, str(Path(args.runs_dir).resolve()), used))
    else:
        from fedllm.flower import worker_restart

        def serve() -> None:
            serve_clientapps(args.runtime_api_address, secret, Path(args.journal) if args.journal else None,
                             args.poll, args.warm_runs)

        if worker_restart.can_fork():  # a worker that dies is forked again with its imports, not started anew
            sys.exit(worker_restart.serve_forked(serve, import_ahead))
        serve()


if __name__ == "__main__":
    main()
