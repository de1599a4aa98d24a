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
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
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
    """``--port`` of a SuperNode's local runtime API: a free one when not given; a taken one is refused."""
    with socket.socket() as probe:
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
    _existing_file(args.root_certificates, "--root-certificates", "DIR/ca.crt")
    _existing_file(args.auth_key, "--auth-key", f"DIR/nodes/client-{args.client}.key (with --clients N)")
    args.port = local_port(args.port)
    if args.data is not None and not Path(args.data).exists():
        raise InputError(f"--data={args.data}: no such file or directory")
    node_config = f"partition-id={args.client} state-dir='{Path(args.state_dir).resolve()}'"
    if args.data is not None:
        node_config += f" data-path='{Path(args.data).resolve()}'"
    cmd = [processes.tool("flower-supernode"), "--superlink", _address(args.superlink, "--superlink"),
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


def run_config(args: argparse.Namespace) -> str:
    """The ``--run-config`` string of ``fedllm flower run``."""
    parts = [f"recipe='{Path(args.recipe).resolve()}'", f"overrides='{' '.join(args.overrides)}'",
             f"resume={'true' if args.resume else 'false'}", f"overwrite={'true' if args.overwrite else 'false'}",
             f"timeout={float(args.timeout)}", f"probe-mb={float(args.probe_mb)}",
             f"wait-nodes={float(args.wait_nodes)}"]
    return " ".join(parts)


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


def register_nodes(port: int, ca: str, nodes: Path) -> None:
    """Register every ``client-K.pub`` of ``nodes`` with the SuperLink on this machine (once; idempotent)."""
    with flwr_home(f"127.0.0.1:{port}", ca) as env:
        for pub in sorted(nodes.glob("client-*.pub")):
            out = subprocess.run([processes.tool("flwr"), "supernode", "register", str(pub), "fedllm"],
                                 capture_output=True, text=True, env=env)
            text = out.stdout + out.stderr
            if out.returncode != 0 and "already in use" not in text.lower():
                raise RuntimeError(f"registering {pub} with the SuperLink failed: {text[-1000:]}")
            print(f"fedllm flower superlink: node key {pub.name} registered", file=sys.stderr, flush=True)


def _certs(args: argparse.Namespace) -> int:
    from fedllm.flower.certs import write_certificates

    files = write_certificates(Path(args.directory), args.host, args.days, clients=args.clients)
    print("\n".join(str(p) for p in files.values()))
    return 0


def _superlink(args: argparse.Namespace) -> int:
    from fedllm.flower.runtime import write_secret

    with tempfile.TemporaryDirectory(prefix="fedllm-superlink-") as private:
        secret = write_secret(Path(private) / "superexec.secret")
        cmd = superlink_command(args, secret)
        nodes = node_keys_dir(args)
        ca = str(Path(args.certificates, "ca.crt").resolve()) if args.certificates else None
        runner = [sys.executable, "-m", "fedllm.flower.runtime", "serverapps",
                  "--runtime-api-address", f"127.0.0.1:{args.port}", "--secret-file", str(secret)]
        if ca:
            runner += ["--root-certificates", ca]
        if nodes is not None:
            runner += ["--node-keys", str(nodes.resolve())]

        def ready(link: subprocess.Popen) -> None:
            if nodes is not None and wait_for_port(args.port, link):
                register_nodes(args.port, ca, nodes)

        return processes.supervise(lambda: processes.start(cmd), {"ServerApp runner": lambda: processes.start(runner)},
                                   after_start=ready)


def _supernode(args: argparse.Namespace) -> int:
    from fedllm.flower.runtime import write_secret

    if args.no_worker:
        cmd = supernode_command(args, None)
        return processes.supervise(lambda: processes.start(cmd))
    state = Path(args.state_dir).expanduser()
    secret = state / f".worker-{args.client}.secret"
    cmd = supernode_command(args, secret)  # the arguments are checked before anything is written
    write_secret(secret)  # renewed at every start
    worker = [sys.executable, "-m", "fedllm.flower.runtime", "clientapps",
              "--runtime-api-address", f"127.0.0.1:{args.port}", "--secret-file", str(secret),
              "--journal", str(state / f".worker-{args.client}.inflight"), "--warm-runs", str(args.warm_runs)]
    return processes.supervise(lambda: processes.start(cmd), {"node worker": lambda: processes.start(worker)})


def _run(args: argparse.Namespace) -> int:
    from fedllm.flower import APP_DIR

    _existing_file(args.root_certificates, "--root-certificates", "DIR/ca.crt")
    from fedllm.recipe.checks import load_recipe

    # bad recipes fail here, with exit code 2; the strategy's own checks (they import torch and peft: ~9 CPU-s
    # in this process) are left to the ServerApp, whose InputError also makes this command exit 2
    load_recipe(args.recipe, list(args.overrides), ask_strategy=False)
    address = _address(args.superlink, "--superlink")
    if not args.root_certificates and not args.insecure:
        raise InputError("fedllm flower run: give --root-certificates CA (TLS) or --insecure")
    with flwr_home(address, args.root_certificates) as env:
        flwr = processes.tool("flwr")
        started = _json(subprocess.run([flwr, "run", str(APP_DIR), "fedllm", "--run-config", run_config(args),
                                        "--format", "json"], capture_output=True, text=True, env=env))
        if not started.get("success"):
            print(f"fedllm flower run: the SuperLink did not start the run: {started}", file=sys.stderr)
            return 1
        run_id = str(started["run-id"])
        print(f"fedllm flower run: run {run_id} on {address}", file=sys.stderr, flush=True)

        def stop_run() -> None:
            print(f"fedllm flower run: stopping run {run_id} on the SuperLink", file=sys.stderr, flush=True)
            subprocess.run([flwr, "stop", run_id, "fedllm"], env=env, capture_output=True, timeout=60)

        rc = processes.supervise(lambda: processes.start([flwr, "log", run_id, "fedllm", "--stream"], env=env),
                                 on_stop=stop_run)  # until the run ends, or this command is stopped
        if rc >= 128:
            return rc
        return _outcome(flwr, run_id, env)


def _json(proc: subprocess.CompletedProcess) -> dict:
    """The JSON object a ``flwr ... --format json`` command printed (or its error output)."""
    text = proc.stdout
    try:
        return json.loads(text[text.index("{"):])
    except ValueError:
        return {"success": False, "output": (proc.stdout + proc.stderr)[-2000:]}


def _outcome(flwr: str, run_id: str, env: dict, wait_s: float = 120.0) -> int:
    """0 when the run finished as completed; 2 when the federation could not be formed; else 1."""
    from fedllm.flower import BAD_INPUT, FEDERATION_INCOMPLETE

    deadline = time.monotonic() + wait_s
    while True:
        listed = _json(subprocess.run([flwr, "ls", "--run-id", run_id, "fedllm", "--format", "json"],
                                      capture_output=True, text=True, env=env))
        runs = listed.get("runs") or [{}]
        status = str(runs[0].get("status", ""))
        if status.startswith("finished") or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    if status == "finished:completed":
        return 0
    details = str(runs[0].get("status-details", ""))
    print(f"fedllm flower run: run {run_id} ended as {status or 'unknown'}: {details} "
          "(the ServerApp's traceback is in the log above)", file=sys.stderr)
    return 2 if FEDERATION_INCOMPLETE in details or f"({BAD_INPUT})" in details else 1


def add_flower_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``fedllm flower`` sub-commands."""
    sub = parser.add_subparsers(dest="flower_command", required=True)
    p = sub.add_parser("certs", help="create a private CA, a SuperLink certificate and node keys")
    p.add_argument("directory", help="where to write ca.crt, ca.key, server.pem, server.key and nodes/client-K.*")
    p.add_argument("--host", action="append", required=True,
                   help="a name or IP the nodes use to reach the SuperLink (repeat for several)")
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
                   "it across SuperLink restarts)")
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
    p.set_defaults(flower_func=_run)


def run_flower_command(args: argparse.Namespace) -> int:
    """Run the chosen ``fedllm flower`` sub-command."""
    return int(args.flower_func(args) or 0)
