"""``fedllm flower certs|superlink|supernode|run``: the common Flower deployment steps for a recipe.

- ``certs``: a private CA, the SuperLink's TLS certificate and one key pair per client node
  (:mod:`fedllm.flower.certs`).
- ``superlink``: start a SuperLink that runs only fedllm's app (``--isolation process`` with fedllm's own
  ServerApp runner, :mod:`fedllm.flower.runtime`); TLS with ``--certificates DIR``, and then SuperNode
  authentication with the node keys of ``DIR/nodes`` (registered at start, each bound to its client id)
  unless ``--insecure-nodes``; ``--insecure`` (no TLS, no node authentication) for loopback only.
- ``supernode``: start a SuperNode serving client K (its partition of the recipe's data, or all of
  ``--data PATH``) and, beside it, fedllm's node worker, which answers the node's messages with the
  federation kept in memory and keeps the client's state in ``--state-dir`` (``--no-worker``: Flower's
  own per-message ClientApp process instead).
- ``run``: submit a recipe to a SuperLink (``flwr run`` on fedllm's Flower app) and stream its log until
  the run ends (exit 0; 1 when the run failed; 2 when the federation could not be formed); stopping it
  (Ctrl-C, SIGTERM) stops the run on the SuperLink; ``--resume`` continues a run after a server restart.

Every process these commands start is theirs: stopped with them, never left behind
(:mod:`fedllm.flower.processes`). They wrap Flower's own commands (``flower-superlink``,
``flower-supernode``, ``flwr run``); see docs/flower.md for what protects each port.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from fedllm.common.errors import InputError
from fedllm.flower import processes


def _address(value: str, option: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InputError(f"{option}={value!r}: expected HOST:PORT, e.g. 127.0.0.1:9092")
    return value


def _certificates(directory: str | None) -> dict[str, Path]:
    if directory is None:
        return {}
    files = {"ca": Path(directory) / "ca.crt", "cert": Path(directory) / "server.pem",
             "key": Path(directory) / "server.key"}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise InputError(f"--certificates={directory}: missing {', '.join(missing)}; expected ca.crt, "
                         "server.pem and server.key (fedllm flower certs)")
    return files


def node_keys_dir(args: argparse.Namespace) -> Path | None:
    """``DIR/nodes`` of ``--certificates DIR`` when SuperNodes must authenticate (else None)."""
    if not args.certificates or args.insecure_nodes:
        return None
    nodes = Path(args.certificates) / "nodes"
    if not sorted(nodes.glob("client-*.pub")):
        raise InputError(f"--certificates={args.certificates}: no node keys in {nodes} (client-K.pub); create "
                         "them with fedllm flower certs DIR --host NAME --clients N, or give --insecure-nodes to "
                         "accept any SuperNode")
    return nodes


def superlink_command(args: argparse.Namespace, secret: Path) -> list[str]:
    """The ``flower-superlink`` command line for ``fedllm flower superlink``: Flower's SuperLink behind fedllm's
    guard (:mod:`fedllm.flower.superlink`: Control and Runtime APIs for this machine only, files mode 0600)."""
    processes.tool("flower-superlink")  # Flower is installed (else: how to install it)
    cmd = [sys.executable, "-m", "fedllm.flower.superlink", "--host", args.host, "--port", str(args.port),
           "--disable-runtime-dependency-installation", "--isolation", "process",
           "--superexec-auth-secret-file", str(secret)]
    certs = _certificates(args.certificates)
    if certs:
        cmd += ["--ssl-ca-certfile", str(certs["ca"]), "--ssl-certfile", str(certs["cert"]),
                "--ssl-keyfile", str(certs["key"])]
        if node_keys_dir(args) is not None:
            cmd.append("--enable-supernode-auth")
    elif args.insecure:
        cmd.append("--insecure")
    else:
        raise InputError("fedllm flower superlink: give --certificates DIR (TLS) or --insecure")
    cmd += ["--database", args.database]
    return cmd


def _existing_file(given: str | None, option: str, written_as: str) -> None:
    """Refuse a certificate or key path that is no file, saying where ``fedllm flower certs`` writes it."""
    if given is not None and not Path(given).expanduser().is_file():
        raise InputError(f"{option}={given}: no such file; fedllm flower certs DIR writes it as {written_as}")


def local_port(port: int | None) -> int:
    """``--port`` of a SuperNode's local runtime API: a free one when not given; one a live process listens on is
    refused. The probe binds as the SuperNode's own server does (``SO_REUSEADDR``), so the connections a killed
    SuperNode left in TIME-WAIT on its port (about 60 s after ``kill -9``) do not refuse its restart."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port or 0))
        except OSError:
            raise InputError(f"--port={port}: already in use on 127.0.0.1 (another SuperNode?); give each SuperNode "
                             "on this machine its own --port, or leave it out for a free one") from None
        return probe.getsockname()[1]


def supernode_command(args: argparse.Namespace, secret: Path | None) -> list[str]:
    """The ``flower-supernode`` command line for ``fedllm flower supernode`` (``secret``: the worker's); sets
    ``args.port`` to a free port when none was given."""
    if args.client < 0:
        raise InputError(f"--client={args.client}: expected an integer >= 0 (the client id)")
    if getattr(args, "wait_superlink", 0) < 0:
        raise InputError(f"--wait-superlink={args.wait_superlink:g}: expected seconds >= 0")
    _existing_file(args.root_certificates, "--root-certificates", "DIR/ca.crt")
    _existing_file(args.auth_key, "--auth-key", f"DIR/nodes/client-{args.client}.key (with --clients N)")
    args.port = local_port(args.port)
    if args.data is not None and not Path(args.data).exists():
        raise InputError(f"--data={args.data}: no such file or directory")
    node_config = f"partition-id={args.client} state-dir='{Path(args.state_dir).resolve()}'"
    if args.data is not None:
        node_config += f" data-path='{Path(args.data).resolve()}'"
    node_config += secagg_identity(args)
    processes.tool("flower-supernode")  # Flower is installed (else: how to install it)
    cmd = [sys.executable, "-m", "fedllm.flower.supernode", "--superlink", _address(args.superlink, "--superlink"),
           "--host", "127.0.0.1", "--port", str(args.port), "--node-config", node_config]
    if secret is not None:
        cmd += ["--isolation", "process", "--superexec-auth-secret-file", str(secret)]
    if args.root_certificates:
        cmd += ["--root-certificates", args.root_certificates]
        if args.auth_key:
            cmd += ["--auth-supernode-private-key", args.auth_key]
        elif not args.insecure_nodes:
            raise InputError("fedllm flower supernode: give --auth-key KEY (this client's nodes/client-K.key from "
                             "fedllm flower certs) or --insecure-nodes (a SuperLink that accepts any node)")
    elif args.insecure:
        cmd.append("--insecure")
    else:
        raise InputError("fedllm flower supernode: give --root-certificates CA (TLS) or --insecure")
    return cmd


def secagg_identity(args: argparse.Namespace) -> str:
    """``--node-config`` entries binding the node's SecAgg+ keys to its identity (:mod:`fedllm.flower.secagg_stages`):
    its ``--auth-key`` signs them, and its neighbours' are verified against ``--peer-keys`` (default: the directory of
    ``--auth-key`` when it holds the clients' ``client-K.pub``, as ``fedllm flower certs`` writes them)."""
    peers = getattr(args, "peer_keys", None)
    if peers is not None and not sorted(Path(peers).glob("client-*.pub")):
        raise InputError(f"--peer-keys={peers}: no client-K.pub files; expected the nodes/ directory of fedllm flower "
                         "certs (every client's registered node public key)")
    if peers is None and args.auth_key and sorted(Path(args.auth_key).expanduser().parent.glob("client-*.pub")):
        peers = str(Path(args.auth_key).expanduser().parent)
    out = f" node-key='{Path(args.auth_key).expanduser().resolve()}'" if args.auth_key else ""
    return out + (f" peer-keys='{Path(peers).expanduser().resolve()}'" if peers else "")


def run_config(args: argparse.Namespace) -> dict:
    """The ``--run-config`` entries of ``fedllm flower run``, signed with ``args.operator_key`` when one is given."""
    from fedllm.flower.authorise import sign

    recipe = Path(args.recipe).resolve()
    config = {"recipe": str(recipe), "overrides": " ".join(args.overrides), "resume": bool(args.resume),
              "overwrite": bool(args.overwrite), "timeout": float(args.timeout), "probe-mb": float(args.probe_mb),
              "wait-nodes": float(args.wait_nodes)}
    return sign(config, recipe.read_bytes(), Path(args.operator_key)) if args.operator_key else config


def config_text(config: dict) -> str:
    """``config`` as Flower's ``--run-config`` string (``key=value`` pairs; strings quoted, no escapes)."""
    parts = []
    for key, value in config.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        elif "'" not in value:
            text = f"'{value}'"
        elif '"' not in value and "\\" not in value:
            text = f'"{value}"'
        else:
            raise InputError(f"{key}={value!r}: holds both quote characters (or a backslash); Flower's --run-config "
                             "cannot carry it: rename the file or quote the override differently")
        parts.append(f"{key}={text}")
    return " ".join(parts)


def operator_key(args: argparse.Namespace) -> Path | None:
    """The operator's signing key of ``fedllm flower run``: ``--operator-key``, else ``operator.key`` beside
    ``--root-certificates`` (``fedllm flower certs`` writes both in one directory), else None."""
    from fedllm.flower.authorise import PRIVATE

    if args.operator_key:
        _existing_file(args.operator_key, "--operator-key", f"DIR/{PRIVATE}")
        return Path(args.operator_key)
    beside = Path(args.root_certificates).parent / PRIVATE if args.root_certificates else None
    return beside if beside is not None and beside.is_file() else None


@contextmanager
def flwr_home(address: str, root_certificates: str | None):
    """A private ``FLWR_HOME`` whose config names this SuperLink as ``fedllm``; yields the environment."""
    import shutil

    home = tempfile.mkdtemp(prefix="fedllm-flwr-")
    try:
        conn = f'address = "{address}"\n' + (f'root-certificates = "{Path(root_certificates).resolve()}"\n'
                                            if root_certificates else "insecure = true\n")
        Path(home, "config.toml").write_text(f'[superlink]\ndefault = "fedllm"\n\n[superlink.fedllm]\n{conn}')
        yield processes.child_env({"FLWR_HOME": home})
    finally:
        shutil.rmtree(home, ignore_errors=True)


def wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 120.0) -> bool:
    """True once 127.0.0.1:``port`` accepts connections; False if ``proc`` exited or the time ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.2)
    return False


def register_nodes(port: int, ca: str, nodes: Path, known: set[bytes], ready: Path) -> None:
    """Register the ``client-K.pub`` keys of ``nodes`` not ``known`` to the SuperLink on this machine, then write
    ``ready`` (its Fleet API then takes SuperNodes: :mod:`fedllm.flower.superlink`)."""
    from fedllm.flower.node_keys import register

    with flwr_home(f"127.0.0.1:{port}", ca) as env:
        register(nodes, env, processes.tool("flwr"), known,
                 lambda line: print(f"fedllm flower superlink: {line}", file=sys.stderr, flush=True))
    ready.touch()
    print("fedllm flower superlink: ready: SuperNodes may join", file=sys.stderr, flush=True)


def _certs(args: argparse.Namespace) -> int:
    from fedllm.flower.certs import write_certificates

    if args.operator_only:
        from fedllm.flower.authorise import PRIVATE, PUBLIC, write_operator_key

        taken = [str(p) for p in (Path(args.directory) / PRIVATE, Path(args.directory) / PUBLIC) if p.exists()]
        if taken:
            raise InputError(f"{args.directory}: {', '.join(taken)} already exist")
        files = write_operator_key(Path(args.directory))
    else:
        if not args.host:
            raise InputError("fedllm flower certs: give --host NAME (the SuperLink's name or IP; repeat for several)")
        files = write_certificates(Path(args.directory), args.host, args.days, clients=args.clients)
    print("\n".join(str(p) for p in files.values()))
    return 0


def operator_public_key(args: argparse.Namespace) -> Path | None:
    """The operator's public key the ServerApp verifies runs with: ``--operator-pub``, else ``DIR/operator.pub`` of
    ``--certificates DIR`` (required there); None without either (``--insecure``: unsigned runs accepted)."""
    from fedllm.flower.authorise import PUBLIC

    if args.operator_pub:
        _existing_file(args.operator_pub, "--operator-pub", f"DIR/{PUBLIC}")
        return Path(args.operator_pub)
    if not args.certificates:
        return None
    pub = Path(args.certificates) / PUBLIC
    if not pub.is_file():
        raise InputError(f"--certificates={args.certificates}: no {pub}: runs must be signed by the operator; create "
                         f"the key pair with fedllm flower certs {args.certificates} --operator-only (operator.key stays "
                         "with whoever runs fedllm flower run)")
    return pub


def _superlink(args: argparse.Namespace) -> int:
    from fedllm.flower.runtime import write_secret

    for stale in processes.remove_stale_private_dirs():
        print(f"fedllm flower superlink: removed {stale}, left by a SuperLink that was killed", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix=processes.PRIVATE_PREFIX) as private:
        (Path(private) / "owner.pid").write_text(processes.owner_line())
        secret = write_secret(Path(private) / "superexec.secret")
        cmd = superlink_command(args, secret)
        nodes = node_keys_dir(args)
        ready = Path(private) / "ready"
        if nodes is not None:  # its Fleet API answers 503 until the node keys are registered
            from fedllm.flower.node_keys import registered

            known = registered(args.database)  # before the SuperLink opens the database
            cmd += ["--fedllm-ready-file", str(ready)]
        ca = str(Path(args.certificates, "ca.crt").resolve()) if args.certificates else None
        runner = [sys.executable, "-m", "fedllm.flower.runtime", "serverapps",
                  "--runtime-api-address", f"127.0.0.1:{args.port}", "--secret-file", str(secret)]
        if ca:
            runner += ["--root-certificates", ca]
        if nodes is not None:
            runner += ["--node-keys", str(nodes.resolve())]
        pub = operator_public_key(args)
        if pub is not None:
            runner += ["--operator-pub", str(pub.resolve())]
        else:
            print("fedllm flower superlink: no operator key (--operator-pub): any run submitted on this machine is "
                  "accepted unsigned", file=sys.stderr, flush=True)
        used = Path(args.database + ".fedllm-nonces") if not args.database.startswith(":") else Path(private) / "nonces"
        runner += ["--runs-dir", str(Path(args.runs_dir).resolve()), "--used-nonces", str(used)]

        restarted = not args.database.startswith(":") and Path(args.database).is_file()
        began = datetime.now(UTC)

        def after_start(link: subprocess.Popen) -> None:
            if (nodes is not None or restarted) and wait_for_port(args.port, link):
                if nodes is not None:  # first: the nodes pulling an orphaned run's message then hear of its end at once
                    register_nodes(args.port, ca, nodes, known, ready)
                if restarted:
                    stop_orphaned_runs(args.port, ca, began)

        return processes.supervise(lambda: processes.start(cmd), {"ServerApp runner": lambda: processes.start(runner)},
                                   after_start=after_start)


def stop_orphaned_runs(port: int, ca: str | None, began: datetime) -> None:
    """Stop the runs a SuperLink restarted on its database still lists as running: their ServerApp died with the
    previous SuperLink, so nothing will finish them, and a node pulling one of their messages would wait minutes for
    objects nobody pushes. Stopped, their nodes give up at once (:func:`fedllm.flower.restart.orphaned_runs`)."""
    from fedllm.flower.restart import orphaned_runs

    with flwr_home(f"127.0.0.1:{port}", ca) as env:
        flwr = processes.tool("flwr")
        listed = _json(subprocess.run([flwr, "ls", "fedllm", "--format", "json"], capture_output=True, text=True,
                                      env=env, check=False))
        for run_id in orphaned_runs(listed.get("runs") or [], began):
            subprocess.run([flwr, "stop", run_id, "fedllm"], env=env, capture_output=True, timeout=120, check=False)
            print(f"fedllm flower superlink: stopped run {run_id}: its ServerApp died with the previous SuperLink; "
                  "continue it with fedllm flower run ... --resume", file=sys.stderr, flush=True)


def _supernode(args: argparse.Namespace) -> int:
    from fedllm.flower.rejoin import serve_node
    from fedllm.flower.runtime import write_secret

    state = Path(args.state_dir).expanduser()
    secret = None if args.no_worker else state / f".worker-{args.client}.secret"
    cmd = supernode_command(args, secret)  # the arguments are checked before anything is written
    helpers = {}
    if secret is not None:
        write_secret(secret)  # renewed at every start
        worker = [sys.executable, "-m", "fedllm.flower.runtime", "clientapps",
                  "--runtime-api-address", f"127.0.0.1:{args.port}", "--secret-file", str(secret),
                  "--journal", str(state / f".worker-{args.client}.inflight"), "--warm-runs", str(args.warm_runs)]
        helpers["node worker"] = lambda: processes.start(worker)

    def superlink_ready() -> bool:
        from fedllm.flower.reach import wait_for_superlink

        return wait_for_superlink(args.superlink, args.root_certificates, args.wait_superlink,
                                  lambda line: print(f"fedllm flower supernode: {line}", file=sys.stderr, flush=True))

    def refused_why() -> str:
        from fedllm.flower.node_keys import public_bytes
        from fedllm.flower.reach import key_status, refusal_cause

        key = public_bytes(Path(args.auth_key).expanduser()) if args.auth_key else b""
        return refusal_cause(key_status(args.superlink, args.root_certificates, key) if key else "")

    def end_dead_session(marker: Path) -> str:
        from fedllm.flower.dead_session import end_if_dead

        return end_if_dead(marker, args.superlink, args.root_certificates, args.auth_key)

    return serve_node(cmd, helpers, state, args.client, superlink_ready, refused_why, end_dead_session)


def _run(args: argparse.Namespace) -> int:
    from fedllm.flower import APP_DIR

    _existing_file(args.root_certificates, "--root-certificates", "DIR/ca.crt")
    from fedllm.recipe.checks import load_recipe

    # bad recipes fail here, with exit code 2; the strategy's own checks (they import torch and peft: ~9 CPU-s
    # in this process) are left to the ServerApp, whose InputError also makes this command exit 2
    recipe = load_recipe(args.recipe, list(args.overrides), ask_strategy=False)
    if recipe.federation.mode == "async":
        raise InputError(f"{recipe.source}: federation.mode: async (FedBuff) runs in simulation only (fedllm train): "
                         "Flower's ServerApp drives synchronous rounds of sampled nodes; give federation.mode: sync")
    address = _address(args.superlink, "--superlink")
    if not args.root_certificates and not args.insecure:
        raise InputError("fedllm flower run: give --root-certificates CA (TLS) or --insecure")
    args.operator_key = operator_key(args)
    config = run_config(args)
    with flwr_home(address, args.root_certificates) as env:
        flwr = processes.tool("flwr")
        started = _json(subprocess.run([flwr, "run", str(APP_DIR), "fedllm", "--run-config", config_text(config),
                                        "--format", "json"], capture_output=True, text=True, env=env))
        if not started.get("success"):
            print(f"fedllm flower run: the SuperLink did not start the run: {started}", file=sys.stderr)
            return 1
        run_id = str(started["run-id"])
        print(f"fedllm flower run: run {run_id} on {address}", file=sys.stderr, flush=True)

        def stop_run() -> None:
            print(f"fedllm flower run: stopping run {run_id} on the SuperLink", file=sys.stderr, flush=True)
            subprocess.run([flwr, "stop", run_id, "fedllm"], env=env, capture_output=True, timeout=60)

        me = os.getpid()
        guard = {"run guard": lambda: processes.Forked(lambda: guard_run(stop_run, env["FLWR_HOME"], me))}
        rc = processes.supervise(lambda: processes.start([flwr, "log", run_id, "fedllm", "--stream"], env=env),
                                 guard, on_stop=stop_run)  # until the run ends, or this command is stopped
        if rc >= 128:
            return rc
        return _outcome(flwr, run_id, env, args)


def guard_run(stop_run, home: str, parent: int) -> int:
    """The child of ``fedllm flower run`` (pid ``parent``) that stops its run when the command is killed (``kill -9``,
    a crash): it gets SIGTERM when its parent dies (:mod:`fedllm.flower.processes`) and, its parent gone, stops the
    run on the SuperLink and removes the command's private FLWR_HOME ``home``, as the command would have. A SIGTERM
    from the living command (the run ended, or was stopped by it) ends it with nothing else done."""
    import shutil
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the command, which stops the run itself
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # kept pending until asked for: no lost wake-up
    while os.getppid() == parent:
        if signal.sigtimedwait([signal.SIGTERM], 60) is not None:
            break
    if os.getppid() != parent:
        stop_run()
        shutil.rmtree(home, ignore_errors=True)
    return 0


def _json(proc: subprocess.CompletedProcess) -> dict:
    """The JSON object a ``flwr ... --format json`` command printed (or its error output)."""
    text = proc.stdout
    try:
        return json.loads(text[text.index("{"):])
    except ValueError:
        return {"success": False, "output": (proc.stdout + proc.stderr)[-2000:]}


def answers(address: str, timeout_s: float = 2.0) -> bool:
    """True when something accepts connections at ``address`` (HOST:PORT)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def restart_hint(args: argparse.Namespace) -> str:
    """What to run when the SuperLink of ``fedllm flower run`` died: restart it on its database, then resume."""
    return ("restart it on the machine it ran on with the same options and the same --database FILE (fedllm flower "
            "superlink ... --database FILE: without one, the SuperLink's state died with it and every SuperNode "
            f"must be restarted too), then continue the run from its newest checkpoint with:\n  {resume_command(args)}")


def resume_command(args: argparse.Namespace) -> str:
    """``fedllm flower run`` as given, with ``--resume``."""
    tls = f"--root-certificates {args.root_certificates}" if args.root_certificates else "--insecure"
    return " ".join(["fedllm flower run", str(args.recipe), *args.overrides, "--superlink", args.superlink, tls,
                     "--resume"])


def _outcome(flwr: str, run_id: str, env: dict, args: argparse.Namespace, wait_s: float = 120.0) -> int:
    """0 when the run finished as completed; 2 when the federation could not be formed; else 1 (with what to do
    when the SuperLink died)."""
    from fedllm.flower import BAD_INPUT, FEDERATION_INCOMPLETE

    deadline, unanswered = time.monotonic() + wait_s, 0
    while True:
        listed = _json(subprocess.run([flwr, "ls", "--run-id", run_id, "fedllm", "--format", "json"],
                                      capture_output=True, text=True, env=env))
        runs = listed.get("runs") or [{}]
        status = str(runs[0].get("status", ""))
        unanswered = unanswered + 1 if not status and not answers(args.superlink) else 0
        if unanswered >= 3:
            print(f"fedllm flower run: the SuperLink at {args.superlink} stopped answering before run {run_id} "
                  f"finished (stopped or killed?); {restart_hint(args)}", file=sys.stderr)
            return 1
        if status.startswith("finished") or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    if status == "finished:completed":
        return 0
    details = str(runs[0].get("status-details", ""))
    bad_input = FEDERATION_INCOMPLETE in details or f"({BAD_INPUT})" in details
    print(f"fedllm flower run: run {run_id} ended as {status or 'unknown'}: {details}"
          + ("" if bad_input or not status else " (the ServerApp's own output is in the log above)"), file=sys.stderr)
    if FEDERATION_INCOMPLETE in details and not args.resume:  # its output_dir now holds the run's partition: a plain
        # re-run is refused ("already holds a run"); --resume starts it from round 0
        print(f"fedllm flower run: once every SuperNode runs, start it with:\n  {resume_command(args)}",
              file=sys.stderr)
    return 2 if bad_input else 1


def _status(args: argparse.Namespace) -> int:
    """``fedllm flower status RUN_DIR``: the run's status once, every few seconds (``--watch``) or as a live page."""
    from fedllm.common.errors import check_local_path
    from fedllm.runs.live_status import format_status, run_status

    check_local_path(args.run_dir, "run directory", hub_ok=False)
    try:
        status = run_status(args.run_dir)
    except FileNotFoundError as e:
        raise InputError(f"{e}; expected the output_dir of a run (its recipe.yaml, metrics.jsonl)") from None
    if args.serve:
        from fedllm.commands.serve import bind
        from fedllm.flower.status_page import serve_status

        sock = bind(args.host, args.port)
        if args.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"warning: the status page listens on {args.host}: anyone who reaches it sees the run's progress",
                  file=sys.stderr)
        try:
            serve_status(args.run_dir, sock)
        finally:
            sock.close()
        return 0
    print(format_status(status), flush=True)
    while args.watch and status["state"] != "finished":
        time.sleep(args.watch)
        status = run_status(args.run_dir)
        print("\n" + format_status(status), flush=True)
    return 0


def add_flower_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``fedllm flower`` sub-commands."""
    sub = parser.add_subparsers(dest="flower_command", required=True)
    p = sub.add_parser("certs", help="create a private CA, a SuperLink certificate and node keys")
    p.add_argument("directory", help="where to write ca.crt, ca.key, server.pem, server.key and nodes/client-K.*")
    p.add_argument("--host", action="append",
                   help="a name or IP the nodes use to reach the SuperLink (repeat for several)")
    p.add_argument("--operator-only", action="store_true",
                   help="write only the operator's signing key pair (operator.key, operator.pub) into DIR")
    p.add_argument("--clients", type=int, default=0,
                   help="create a node key pair for each client 0..N-1 (nodes/client-K.key, client-K.pub)")
    p.add_argument("--days", type=int, default=365, help="validity")
    p.set_defaults(flower_func=_certs)

    p = sub.add_parser("superlink", help="start a Flower SuperLink that runs only fedllm's app")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; default 127.0.0.1 (this machine only); 0.0.0.0 to take SuperNodes "
                        "from the network (docs/flower.md: what protects the port)")
    p.add_argument("--port", type=int, default=9092, help="port of the SuperLink (nodes and flwr run use it)")
    p.add_argument("--certificates", help="directory from fedllm flower certs: ca.crt, server.pem, server.key (TLS) "
                   "and nodes/client-K.pub (the only SuperNodes accepted, client K only from key K)")
    p.add_argument("--insecure", action="store_true",
                   help="no TLS and no SuperNode authentication (loopback or a trusted network only)")
    p.add_argument("--insecure-nodes", action="store_true",
                   help="with TLS, accept any SuperNode (no node keys); the first node to claim a client serves it")
    p.add_argument("--database", default=":flwr-in-memory:", help="SuperLink state database (a file path to keep "
                   "it across SuperLink restarts; written mode 0600)")
    p.add_argument("--operator-pub", help="the operator's public key (default with --certificates DIR: "
                   "DIR/operator.pub): only runs signed with its private key run")
    p.add_argument("--runs-dir", default=".", help="the only directory runs may write to (a recipe's output_dir must "
                   "be inside it); default: the directory this command starts in")
    p.set_defaults(flower_func=_superlink)

    p = sub.add_parser("supernode", help="start a SuperNode serving one client (and its fedllm worker)")
    p.add_argument("--superlink", required=True, help="HOST:PORT of the SuperLink")
    p.add_argument("--client", type=int, required=True, help="client id (0-based): its partition of the data")
    p.add_argument("--data", help="this client's own data file (instead of a partition of the recipe's data)")
    p.add_argument("--state-dir", default=str(Path.home() / ".fedllm" / "flower-state"),
                   help="where this client's state is kept between rounds (and node restarts)")
    p.add_argument("--port", type=int, default=None,
                   help="port of the node's local runtime API (127.0.0.1 only); default: a free one")
    p.add_argument("--root-certificates", help="CA certificate of the SuperLink (TLS)")
    p.add_argument("--insecure", action="store_true", help="no TLS (and no node authentication)")
    p.add_argument("--auth-key", help="this node's private key (nodes/client-K.key from fedllm flower certs)")
    p.add_argument("--insecure-nodes", action="store_true", help="connect without a node key (TLS only)")
    p.add_argument("--peer-keys", help="directory of every client's node public key (client-K.pub): SecAgg+ keys of "
                   "other clients are verified against them; default: the directory of --auth-key when it has them")
    p.add_argument("--wait-superlink", type=float, default=600,
                   help="seconds to wait for the SuperLink to take nodes (not started yet, or registering the node "
                        "keys), saying what it waits for, before giving up (exit 1)")
    p.add_argument("--warm-runs", type=int, default=2,
                   help="how many runs' federations (model, data) the worker keeps in memory at once")
    p.add_argument("--no-worker", action="store_true",
                   help="no fedllm worker: Flower starts fedllm's ClientApp in a new process per message")
    p.set_defaults(flower_func=_supernode)

    p = sub.add_parser("run", help="run a recipe on a SuperLink's federation")
    p.add_argument("recipe", help="recipe YAML (its path must also be readable where the SuperLink runs)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    p.add_argument("--superlink", required=True, help="HOST:PORT of the SuperLink")
    p.add_argument("--root-certificates", help="CA certificate of the SuperLink (TLS)")
    p.add_argument("--insecure", action="store_true", help="no TLS")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run in output_dir")
    p.add_argument("--timeout", type=float, default=3600, help="seconds to wait for the clients of a round")
    p.add_argument("--wait-nodes", type=float, default=120,
                   help="seconds to wait at start for one SuperNode per client (progress every 5 s), then exit 2")
    p.add_argument("--probe-mb", type=float, default=0, help="check the transport with a tensor of this many MB")
    p.add_argument("--operator-key", help="the operator's private key that signs the run (default: operator.key "
                   "beside --root-certificates, as fedllm flower certs writes them)")
    p.set_defaults(flower_func=_run)

    p = sub.add_parser("status", help="a run's progress: round, nodes, clients (arrived, late, dropped), bytes, "
                       "losses, epsilon, ETA; in the terminal or as a live page")
    p.add_argument("run_dir", help="the run's output_dir (on the SuperLink's machine: inside its --runs-dir)")
    p.add_argument("--watch", type=float, nargs="?", const=5.0, default=0.0, metavar="SECONDS",
                   help="print it again every SECONDS (default 5) until the run finishes")
    p.add_argument("--serve", action="store_true", help="serve a live page (read-only) instead of printing")
    p.add_argument("--host", default="127.0.0.1", help="address of the page; default 127.0.0.1 (this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port of the page")
    p.set_defaults(flower_func=_status)


def run_flower_command(args: argparse.Namespace) -> int:
    """Run the chosen ``fedllm flower`` sub-command."""
    return int(args.flower_func(args) or 0)
