"""A connection cut mid-upload or mid-download on a real Flower deployment: the SuperNode's request is retried, the
round completes and equals the simulation bit for bit; what is sent again is measured (Flower re-sends the whole
object: a request carries one object, with no offset to resume from)."""

import json
import re
import threading
from collections import Counter

import pytest
import yaml

from fedllm.engine import server
from fedllm.flower.wan_proxy import DOWN, UP
from fedllm.recipe.checks import parse_recipe
from tests.flower_cluster import assert_matches, wait_until
from tests.flower_wan.wan_cluster import wan_deployment

REQUEST = re.compile(rb"(?:POST|GET) /[A-Za-z0-9_/\-]*?([a-z\-]+) HTTP")


class RequestBytes:
    """Bytes per direction and Fleet API path through one proxy: each chunk counted to the request it belongs to (a
    response to the request its connection carried last)."""

    def __init__(self):
        self.lock, self.bytes, self.path = threading.Lock(), {UP: Counter(), DOWN: Counter()}, {}

    def __call__(self, connection, direction, data):
        with self.lock:
            if direction == UP:
                for match in REQUEST.finditer(data):
                    self.path[connection] = match.group(1).decode()
            self.bytes[direction][self.path.get(connection, "?")] += len(data)


@pytest.mark.slow
@pytest.mark.parametrize(("direction", "armed_at", "path"), [
    (UP, "Receiving: train message", "push-object"),  # what node 1 sends next: its reply (~57 kB of adapter)
    (DOWN, "Sending: query.fedllm message", "pull-object"),  # what it receives next: polls, then its train message
])
def test_a_cut_transfer_resumes_and_the_round_equals_the_simulation(tiny_recipe, tmp_path, direction, armed_at, path):
    raw = tiny_recipe(federation={"num_clients": 2, "clients_per_round": 2, "rounds": 1}, lora={"r": 32, "alpha": 64})
    raw["output_dir"] = str(tmp_path / "flower-run")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    taps = {0: RequestBytes(), 1: RequestBytes()}
    with wan_deployment(tmp_path, 2, observers=taps) as (port, proxies, _, launch):
        run = launch(["flower", "run", str(recipe), "--superlink", f"127.0.0.1:{port}", "--insecure", "--timeout",
                      "600"], "run.log")
        node_log = tmp_path / "supernode1.log"
        wait_until(lambda: armed_at in node_log.read_text(errors="replace"), 600, armed_at, node_log, every_s=0.02)
        proxies[1].cut_after(direction, 16384)  # 16 kB into what node 1 sends or receives next
        assert run.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
        cuts = proxies[1].stats.cuts
    assert len(cuts) == 1, cuts
    sent = {c: dict(t.bytes[direction]) for c, t in taps.items()}
    resent = sent[1].get(path, 0) - sent[0].get(path, 0)
    (tmp_path / "resent.json").write_text(json.dumps({"sent": sent, f"resent_{path}": resent}))
    print(f"{direction} bytes by path: {sent}; {path} bytes sent again to or by the cut node: {resent}")
    # the object cut mid-request is sent again whole: more than nothing, at most the one object
    assert 0 < resent <= sent[0][path], sent

    sim = server.run(parse_recipe({**raw, "output_dir": str(tmp_path / "sim")})).run_dir
    assert_matches(sim, tmp_path / "flower-run", ["adapter"], "cut upload", exact=True)
