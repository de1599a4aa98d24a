"""fedllm's SuperLink guard (fedllm.flower.superlink): only the Fleet API and the health check answer the network;
the Control API (submit, stop, read logs, register and unregister nodes) and the Runtime API answer this machine
only; the SuperLink's database is mode 0600 from its creation. Checked on the rule itself and on a real
``fedllm flower superlink --host 0.0.0.0`` reached through this machine's network address."""

import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from flower_cluster import env_for, free_port, port_open, start, stop, wait_until, write_flwr_home

from fedllm.flower.superlink import allowed, is_local

pytest.importorskip("flwr")


@pytest.mark.parametrize("path, client, ok", [
    ("/v1/fleet/activate-node", ("203.0.113.7", 5000), True),
    ("/health", ("203.0.113.7", 5000), True),
    ("/v1/control/start-run", ("203.0.113.7", 5000), False),
    ("/v1/control/unregister-supernode", ("10.0.0.2", 1), False),
    ("/v1/runtime/pull-task-input", ("192.168.1.4", 1), False),
    ("/v1/control/start-run", ("127.0.0.1", 5000), True),
    ("/v1/control/stop-run", ("127.0.0.53", 5000), True),
    ("/v1/runtime/acquire-task", ("::1", 5000), True),
    ("/v1/control/list-runs", ("::ffff:127.0.0.1", 5000), True),
    ("/v1/control/list-runs", ("::ffff:10.0.0.1", 5000), False),
    ("/v1/control/list-runs", None, False),  # no peer address (a Unix socket): not trusted
    ("/v1/control/list-runs", ("testclient", 50000), False),
    ("/v1/fleetx/../control/start-run", ("203.0.113.7", 5000), False),
])
def test_flower_security_guard_lets_the_network_reach_only_the_fleet_api(path, client, ok):
    assert allowed(path, client) is ok
    assert is_local(client) is (client is not None and client[0] in ("127.0.0.1", "127.0.0.53", "::1",
                                                                      "::ffff:127.0.0.1"))


def network_address() -> str | None:
    """This machine's address on its network (not loopback), or None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.254.254.254", 9))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def post(url: str) -> tuple[int, str]:
    request = urllib.request.Request(url, data=b"", method="POST", headers={"Content-Type": "application/protobuf"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@pytest.mark.slow
def test_flower_security_exposed_superlink_serves_control_only_to_its_machine(tmp_path):
    address = network_address()
    if address is None:
        pytest.skip("this machine has no network address besides loopback")
    port, database = free_port(), tmp_path / "link" / "state.db"
    database.parent.mkdir()
    env = env_for(tmp_path / "flwr-home")
    link = start(["flower", "superlink", "--insecure", "--host", "0.0.0.0", "--port", str(port), "--database",
                  str(database)], tmp_path / "superlink.log", env)
    try:
        wait_until(lambda: port_open(port) or link.poll() is not None, 180, "SuperLink port", tmp_path / "superlink.log")
        assert link.poll() is None, (tmp_path / "superlink.log").read_text()[-3000:]
        remote, local = f"http://{address}:{port}", f"http://127.0.0.1:{port}"
        for path in ("/v1/control/list-runs", "/v1/control/stop-run", "/v1/control/unregister-supernode",
                     "/v1/runtime/pull-task-input"):
            code, body = post(remote + path)
            assert code == 403 and "answer only its own machine" in body, (path, code, body)
            assert post(local + path)[0] != 403, path  # Flower's own answer (here: the empty body is refused)
        assert post(remote + "/v1/fleet/activate-node")[0] != 403  # nodes reach the Fleet API from anywhere
        with urllib.request.urlopen(remote + "/health", timeout=30) as response:
            assert response.status == 200
        # what a CA-cert holder on another machine sees with Flower's own CLI
        write_flwr_home(tmp_path / "remote-home", f"{address}:{port}")
        listed = subprocess.run([str(Path(sys.executable).parent / "flwr"), "ls", "fedllm", "--format", "json"],
                                capture_output=True, text=True, env=env_for(tmp_path / "remote-home"), timeout=120)
        assert "answer only its own machine" in listed.stdout + listed.stderr, listed
        written = [p for p in database.parent.iterdir() if p.name.startswith(database.name)]
        assert database in written
        assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in written} == {p.name: "0o600" for p in written}
    finally:
        stop(link)
