"""A ServerApp that dies (killed, out of memory, a crash) while its SuperLink stays up: fedllm's ServerApp runner
reports its task as failed at once, so that the run is finished:failed and its nodes drop its messages (issue 49).

The real runner (:func:`fedllm.flower.runtime.serve_serverapps`: its claim loop, its forked children and its reaping)
against a stand-in of the SuperLink's Runtime API that keeps Flower 1.42's rule for task tokens: a task's token works
until the task is finished, and is refused (401) after (``finish_task`` revokes it). Three ServerApp children in turn:
one finishes its run and exits 0 (as fedllm's does once its outcome, completed or failed, reached the SuperLink), one
reports its run's failure itself and then exits 1 (a crash after the report), one is killed (SIGKILL) before reporting
anything. Only the last run is stopped by the runner; the second is asked about and refused, the first never. The end-to-end figures (a real deployment, a node
pulling the dead run's message) are in docs/flower.md, from ``bench/flower_restart_pull.py --kill-serverapp``.
"""

import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from flower_cluster import wait_until

from fedllm.flower import processes, runtime

RUNS = {"completed": 11, "reported": 12, "killed": 13}
"""Task token -> its run id; the token also says what the fake ServerApp child does."""


class RuntimeAPI(ThreadingHTTPServer):
    """Flower's Runtime API as the runner and its children use it: AcquireTask hands out the tokens the test queues,
    PushTaskOutput finishes an open task (and revokes its token) or answers 401."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.queued: list[str] = []
        self.open: set[str] = set()
        self.finished: list[tuple[str, str, str]] = []  # (token, sub_status, details) in the order taken
        self.refused: list[str] = []  # tokens of refused reports
        self.lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    server: RuntimeAPI

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        from flwr.proto.runtime_pb2 import AcquireTaskResponse, PushTaskOutputRequest, PushTaskOutputResponse
        from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
        from flwr.supercore.constant import TASK_TOKEN_HEADER

        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        api, status, reply = self.server, 200, b""
        with api.lock:
            if self.path == "/v1/runtime/acquire-task":
                res = AcquireTaskResponse()
                if api.queued:
                    token = api.queued.pop(0)
                    api.open.add(token)
                    res = AcquireTaskResponse(task=Task(task_id=RUNS[token], run_id=RUNS[token]), token=token)
                reply = res.SerializeToString()
            elif self.path == "/v1/runtime/push-task-output":
                token, req = self.headers.get(TASK_TOKEN_HEADER), PushTaskOutputRequest.FromString(body)
                if token in api.open:
                    api.open.discard(token)
                    api.finished.append((token, req.sub_status, req.details))
                    reply = PushTaskOutputResponse().SerializeToString()
                else:
                    api.refused.append(token)
                    status = 401
            else:
                status = 404
        self.send_response(status)
        self.send_header("content-type", "application/protobuf")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


def fake_server_task(pids: Path):
    """What a ServerApp child does, by its token: finish its run (exit 0), report a failure (exit 1), or be killed."""

    def run_server_task(address, token, root_certificates, node_keys, operator=None):
        from flwr.common.constant import SubStatus
        from flwr.proto.runtime_pb2 import PushTaskOutputRequest  # pylint: disable=E0611
        from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor
        from flwr.supercore.runtime import RuntimeHttpClient

        (pids / token).write_text(str(os.getpid()))
        if token == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        client = RuntimeHttpClient.from_server_address(server_address=address, insecure=True, root_certificates=None,
                                                       interceptors=[RuntimeTokenHttpInterceptor(token)])
        status = SubStatus.COMPLETED if token == "completed" else SubStatus.FAILED
        client.PushTaskOutput(PushTaskOutputRequest(sub_status=status, details=f"the child: {token}"))
        client.close()
        return 0 if token == "completed" else 1

    return run_server_task


def test_runner_reports_a_killed_serverapp_and_leaves_finished_runs_alone(tmp_path, monkeypatch, capfd):
    from flwr.common.constant import SubStatus

    api = RuntimeAPI()
    threading.Thread(target=api.serve_forever, daemon=True).start()
    monkeypatch.setattr(runtime, "SERVER_APP_IMPORTS", ())  # torch & co.: nothing here needs them
    monkeypatch.setattr(runtime, "run_server_task", fake_server_task(tmp_path))
    address = f"127.0.0.1:{api.server_address[1]}"
    runner = processes.Forked(lambda: runtime.serve_serverapps(address, b"secret", None, None, poll_s=0.05) or 0)
    said: list[str] = []  # the runner's stderr, read while waiting

    def reaped(token: str) -> bool:  # the child has exited and the runner has collected it (no zombie left)
        pid = tmp_path / token
        return pid.is_file() and pid.read_text() != "" and not Path(f"/proc/{pid.read_text()}").exists()

    try:
        for token in RUNS:  # one at a time: each child collected before the next task is handed out
            with api.lock:
                api.queued.append(token)
            wait_until(lambda t=token: reaped(t), 60, f"the {token} child collected by the runner")
            if token == "reported":  # the runner's report, after the child's: refused, the task being finished
                wait_until(lambda: api.refused, 60, "the runner's report of the reported run")
        wait_until(lambda: len(api.finished) == 3, 60, "the killed ServerApp's task reported by the runner")
        # the runner says so once the SuperLink took its report: wait for the line before stopping the runner
        wait_until(lambda: said.append(capfd.readouterr().err) or "stopped on the SuperLink" in "".join(said), 60,
                   "the runner's line about the killed run")
    finally:
        processes.stop(runner)
        api.shutdown()
        api.server_close()
    assert api.finished[:2] == [("completed", SubStatus.COMPLETED, "the child: completed"),
                                ("reported", SubStatus.FAILED, "the child: reported")]
    token, sub_status, details = api.finished[2]
    assert (token, sub_status) == ("killed", SubStatus.FAILED)
    assert "killed by SIGKILL" in details
    assert api.refused == ["reported"]  # the completed run: never asked about
    err = "".join(said) + capfd.readouterr().err
    stopped = [line for line in err.splitlines() if "stopped on the SuperLink" in line]
    assert len(stopped) == 1 and "run 13 " in stopped[0] and "killed by SIGKILL" in stopped[0]
