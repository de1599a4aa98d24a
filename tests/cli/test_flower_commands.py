"""``fedllm flower`` arguments a newcomer gets wrong, refused before any process starts (no Flower process here)."""

import argparse
import os
import socket
import subprocess
import sys

import pytest

from fedllm.commands.flower import add_flower_arguments, superlink_command, supernode_command
from fedllm.common.errors import InputError


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_flower_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_superlink_listens_on_this_machine_unless_told_otherwise(tmp_path):
    local = superlink_command(parse("superlink", "--insecure"), tmp_path / "secret")
    assert local[local.index("--host") + 1] == "127.0.0.1"
    exposed = superlink_command(parse("superlink", "--insecure", "--host", "0.0.0.0"), tmp_path / "secret")
    assert exposed[exposed.index("--host") + 1] == "0.0.0.0"


def test_certificate_and_key_paths_are_checked_and_say_where_certs_wrote_them(tmp_path):
    args = parse("supernode", "--superlink", "127.0.0.1:9092", "--client", "0", "--root-certificates", "ca.crt",
                 "--auth-key", "client-0.key")
    with pytest.raises(InputError, match=r"--root-certificates=ca.crt: no such file; fedllm flower certs DIR "
                                         r"writes it as DIR/ca.crt"):
        supernode_command(args, None)
    (tmp_path / "ca.crt").write_text("x")
    args.root_certificates = str(tmp_path / "ca.crt")
    with pytest.raises(InputError, match=r"--auth-key=client-0.key: no such file; .* DIR/nodes/client-0.key"):
        supernode_command(args, None)


def test_a_supernode_takes_a_free_local_port_and_refuses_a_taken_one():
    args = parse("supernode", "--superlink", "127.0.0.1:9092", "--client", "1", "--insecure")
    cmd = supernode_command(args, None)
    assert cmd[cmd.index("--port") + 1] == str(args.port) and args.port > 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        args = parse("supernode", "--superlink", "127.0.0.1:9092", "--client", "1", "--insecure",
                     "--port", str(taken.getsockname()[1]))
        with pytest.raises(InputError, match=r"--port=\d+: already in use on 127.0.0.1 .* its own --port"):
            supernode_command(args, None)


def test_a_supernode_restarted_on_its_port_is_not_refused_for_connections_in_time_wait():
    """``kill -9`` of a SuperNode leaves the connections its worker had to its port in TIME-WAIT for about 60 s: the
    port check binds as the SuperNode's server will (SO_REUSEADDR) and accepts the port; a live listener is still
    refused."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the server's side closes first, as a killed SuperNode's does: TIME-WAIT on its port
        client.close()
    with socket.socket() as plain, pytest.raises(OSError):  # what the check did before: refused for ~60 s
        plain.bind(("127.0.0.1", port))
    args = parse("supernode", "--superlink", "127.0.0.1:9092", "--client", "1", "--insecure", "--port", str(port))
    cmd = supernode_command(args, None)
    assert cmd[cmd.index("--port") + 1] == str(port)


def test_the_flower_runtime_filters_third_party_noise_as_the_cli_does():
    """``fedllm flower run`` streams the ServerApp runner's output: transformers' own deprecations stay out of it
    (the CLI's quiet mode), fedllm's warnings stay in."""
    code = ("import warnings, fedllm.flower.runtime as runtime; runtime.configure_logging(); "
            "warnings.warn_explicit('inside transformers', FutureWarning, 'modeling_utils.py', 1, "
            "module='transformers.modeling_utils'); "
            "warnings.warn_explicit('from fedllm', UserWarning, 'server.py', 1, module='fedllm.engine.server')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "FEDLLM_LOG"})
    assert done.returncode == 0, done.stderr
    assert "from fedllm" in done.stderr and "inside transformers" not in done.stderr


def test_flower_security_the_superlink_runs_behind_fedllms_guard(tmp_path):
    cmd = superlink_command(parse("superlink", "--insecure"), tmp_path / "secret")
    assert cmd[:3] == [sys.executable, "-m", "fedllm.flower.superlink"]


def test_flower_run_whose_superlink_died_says_how_to_restart_and_resume(tmp_path, capsys):
    """``flwr ls`` fails and nothing answers at the SuperLink's address any more: ``fedllm flower run`` says so at
    once (not after its two-minute wait) and prints the commands that continue the run."""
    from fedllm.commands.flower import _outcome

    fake_flwr = tmp_path / "flwr"
    fake_flwr.write_text("#!/bin/sh\necho '{\"success\": false, \"error-message\": \"connection refused\"}'\n")
    fake_flwr.chmod(0o755)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    args = parse("run", "recipes/quickstart/smollm2-arith.yaml", "train.lr=0.01", "--superlink", dead,
                 "--root-certificates", "certs/ca.crt")
    assert _outcome(str(fake_flwr), "42", dict(os.environ), args, wait_s=600) == 1
    err = capsys.readouterr().err
    assert f"the SuperLink at {dead} stopped answering before run 42 finished" in err
    assert "--database FILE" in err
    assert (f"fedllm flower run recipes/quickstart/smollm2-arith.yaml train.lr=0.01 --superlink {dead} "
            "--root-certificates certs/ca.crt --resume") in err
    assert "traceback" not in err


@pytest.mark.parametrize("resume", [False, True])
def test_flower_run_stopped_by_missing_supernodes_says_how_to_start_it_again(tmp_path, capsys, resume):
    """The run failed waiting for SuperNodes; its output_dir already holds its partition, so the same command would
    be refused: ``fedllm flower run`` prints the one that starts it (``--resume``: from round 0, no checkpoint)."""
    import json

    from fedllm.commands.flower import _outcome

    failed = {"runs": [{"status": "finished:failed", "status-details": "ServerApp failed with exception: federation "
                        "incomplete: 2 SuperNode(s) connected, 2 of 4 clients served (missing: [2, 3])"}]}
    fake_flwr = tmp_path / "flwr"
    fake_flwr.write_text(f"#!/bin/sh\necho '{json.dumps(failed)}'\n")
    fake_flwr.chmod(0o755)
    argv = ["run", "recipes/frlora/tiny-llama-arith-frlora.yaml", "output_dir=runs/frlora-flower", "--superlink",
            "127.0.0.1:9092", "--root-certificates", "certs/ca.crt"]
    assert _outcome(str(fake_flwr), "7", dict(os.environ), parse(*argv, *(["--resume"] if resume else []))) == 2
    err = capsys.readouterr().err
    assert "missing: [2, 3]" in err
    hint = ("once every SuperNode runs, start it with:\n  fedllm flower run "
            "recipes/frlora/tiny-llama-arith-frlora.yaml output_dir=runs/frlora-flower --superlink 127.0.0.1:9092 "
            "--root-certificates certs/ca.crt --resume")
    assert (hint in err) != resume  # given --resume already, the same command is the one to run again


def test_flower_security_certs_write_the_operator_key_and_superlink_requires_it(tmp_path, capsys):
    from fedllm.commands.flower import _certs, operator_public_key

    certs = tmp_path / "certs"
    assert _certs(parse("certs", str(certs), "--host", "127.0.0.1")) == 0
    assert oct((certs / "operator.key").stat().st_mode & 0o777) == "0o600"
    assert oct((certs / "ca.key").stat().st_mode & 0o777) == "0o600"
    assert operator_public_key(parse("superlink", "--certificates", str(certs))) == certs / "operator.pub"
    (certs / "operator.pub").unlink()
    (certs / "operator.key").unlink()  # a directory made before the operator key existed
    with pytest.raises(InputError, match=rf"no {certs}/operator.pub: runs must be signed by the operator; create the "
                                         rf"key pair with fedllm flower certs {certs} --operator-only"):
        operator_public_key(parse("superlink", "--certificates", str(certs)))
    assert _certs(parse("certs", str(certs), "--operator-only")) == 0
    assert (certs / "operator.pub").is_file()
    with pytest.raises(InputError, match="already exist"):
        _certs(parse("certs", str(certs), "--operator-only"))
    with pytest.raises(InputError, match="give --host NAME"):
        _certs(parse("certs", str(tmp_path / "other")))
    assert operator_public_key(parse("superlink", "--insecure")) is None


def test_a_killed_superlinks_private_directory_is_removed_at_the_next_start(tmp_path):
    """``kill -9`` of ``fedllm flower superlink`` leaves its private directory (a stale secret); the next start
    deletes such directories, and only them: not one whose command runs, not one holding anything else."""
    from fedllm.flower.processes import remove_stale_private_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs
    dirs = {}
    from fedllm.flower.processes import owner_line

    reused = f"{os.getpid()} 1\n"  # this pid, but a process that started at another time: the owner is gone
    for name, line, extra in (("stale", f"{gone.pid}\n", None), ("live", owner_line(), None),
                              ("foreign", f"{gone.pid}\n", "notes.txt"), ("reused", reused, "ready")):
        d = dirs[name] = tmp_path / f"fedllm-superlink-{name}"
        d.mkdir()
        (d / "owner.pid").write_text(line)
        (d / "superexec.secret").write_bytes(b"x" * 32)
        if extra:
            (d / extra).write_text("not fedllm's")
    (tmp_path / "fedllm-superlink-nopid").mkdir()
    assert sorted(remove_stale_private_dirs(tmp_path)) == [dirs["reused"], dirs["stale"]]
    assert not dirs["stale"].exists() and dirs["live"].is_dir() and dirs["foreign"].is_dir()
    assert (tmp_path / "fedllm-superlink-nopid").is_dir()


def test_the_supernode_runs_with_quick_object_pulls():
    """``fedllm flower supernode`` runs Flower's SuperNode through fedllm.flower.supernode, whose object pulls ask
    again after 50 ms (Flower's own: 1 s, doubling to 10 s)."""
    import inspect
    import types

    from fedllm.flower.supernode import quick_object_pulls

    cmd = supernode_command(parse("supernode", "--superlink", "127.0.0.1:9092", "--client", "0", "--insecure"), None)
    assert cmd[:3] == [sys.executable, "-m", "fedllm.flower.supernode"]
    module = types.SimpleNamespace()
    quick_object_pulls(module)
    assert module.pull_objects.keywords == {"initial_backoff": 0.05, "backoff_cap": 0.5}
    flower_default = inspect.signature(module.pull_objects.func).parameters["initial_backoff"].default
    assert flower_default == 1  # what it replaces: if Flower changes it, revisit fedllm.flower.supernode


def test_a_node_that_left_retries_after_growing_waits_for_a_bounded_time():
    from fedllm.flower.rejoin import REJOIN_S, rejoin_delays

    waits = list(rejoin_delays())
    assert waits[:4] == [2.0, 4.0, 8.0, 15.0] and set(waits[4:]) == {15.0}
    assert REJOIN_S - 15.0 < sum(waits) <= REJOIN_S  # Flower's 2 x 30 s heartbeat patience, with a margin


FAKE_SUPERNODE = """
import sys
from pathlib import Path
count = Path(sys.argv[1])
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
if n <= int(sys.argv[2]):  # Flower's SuperNode whose key the SuperLink does not know (yet)
    print("[code: 2004] Failed to activate SuperNode.", flush=True)
    sys.exit(1)
print("SuperNode ID: 7", flush=True)
sys.exit(130)  # then stopped, as by Ctrl-C
"""


@pytest.mark.parametrize("refusals,attempts,rc", [(0, 1, 130), (2, 3, 130), (99, 5, 1)])
def test_a_node_refused_before_its_key_is_registered_retries_for_a_bounded_time(tmp_path, monkeypatch, refusals,
                                                                                  attempts, rc):
    """`fedllm flower superlink` registers the node keys one by one after its port opens: a SuperNode started with
    it is refused until its key is there. It tries again (after 2, 4, 8 and 15 s: 29 s in 4 retries, within 30 s),
    then gives up; a node that ends without a refusal is not retried."""
    from fedllm.flower import rejoin

    slept, sleep = [], rejoin.time.sleep  # the module's time is everyone's: only the retry waits are skipped
    monkeypatch.setattr(rejoin.time, "sleep", lambda s: slept.append(s) if s >= 1 else sleep(s))
    count = tmp_path / "attempts"
    cmd = [sys.executable, "-S", "-c", FAKE_SUPERNODE, str(count), str(refusals)]  # -S: a quick start each
    assert rejoin.serve_node(cmd, {}, tmp_path / "state", 3) == rc
    assert int(count.read_text()) == attempts
    assert slept == [2.0, 4.0, 8.0, 15.0][:attempts - 1]
    assert (tmp_path / "state" / ".node-3.activated").exists() == (rc == 130)


def test_a_node_that_ends_without_being_refused_is_not_retried(tmp_path, monkeypatch):
    from fedllm.flower import rejoin

    sleep = rejoin.time.sleep
    monkeypatch.setattr(rejoin.time, "sleep", lambda s: pytest.fail("retried") if s >= 1 else sleep(s))
    assert rejoin.serve_node([sys.executable, "-c", "import sys; sys.exit(3)"], {}, tmp_path, 0) == 3
