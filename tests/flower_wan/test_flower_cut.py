"""A connection cut mid-download and one cut mid-upload on a real Flower deployment (one run: the download in round 1,
the upload in round 2): the SuperNode's request is retried, each round completes and the run equals the simulation bit
for bit; what is sent again is measured (Flower re-sends the whole object: a request carries one object, with no
offset to resume from)."""

import json
import re
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from fedllm.engine import server
from fedllm.flower.wan_proxy import DOWN, UP, Link
from fedllm.recipe.checks import parse_recipe
from tests.flower_cluster import assert_matches, wait_until
from tests.flower_wan.wan_cluster import logged_times

REQUEST = re.compile(rb"(?:POST|GET) /[A-Za-z0-9_/\-]*?([a-z\-]+) HTTP")
#: Node 1's uplink: 40 kB/s, so that its round-2 reply (~57 kB) takes over a second to go. The cut is armed when the
#: node logs its train message, and must land 16 kB into the reply; on a loopback link the test had only the client's
#: training (~0.4 s) to arm it in before the whole reply had gone.
UPLINK = Link(mbit_s=0.32, burst_bytes=4096)


class RequestBytes:
    """Bytes per direction and Fleet API path through one proxy, in all and per request: each chunk counted to the
    request it belongs to (a response to the request its connection carried last)."""

    def __init__(self):
        self.lock, self.bytes, self.path = threading.Lock(), {UP: Counter(), DOWN: Counter()}, {}
        self.requests = {UP: Counter(), DOWN: Counter()}  # (path, connection, request number) -> bytes
        self.count = Counter()  # connection -> requests it carried

    def __call__(self, connection, direction, data):
        with self.lock:
            if direction == UP:
                for match in REQUEST.finditer(data):
                    self.path[connection] = match.group(1).decode()
                    self.count[connection] += 1
            path = self.path.get(connection, "?")
            self.bytes[direction][path] += len(data)
            self.requests[direction][path, connection, self.count[connection]] += len(data)

    def largest(self, direction, path) -> int:
        """The bytes of the largest request (UP) or response (DOWN) on ``path``: one object for the object paths."""
        return max((n for (p, *_), n in self.requests[direction].items() if p == path), default=0)


@pytest.mark.slow
def test_a_cut_download_and_a_cut_upload_resume_and_the_run_equals_the_simulation(tiny_recipe, tmp_path, wan_runs):
    raw = tiny_recipe(federation={"num_clients": 3, "clients_per_round": 3, "rounds": 2}, lora={"r": 32, "alpha": 64})
    raw["output_dir"] = str(tmp_path / "flower-run")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    taps = {0: RequestBytes(), 1: RequestBytes()}
    # (direction, node 1's log line to arm the cut at, how many times logged by then, the Fleet API path cut)
    cuts_wanted = [(DOWN, "Sending: query.fedllm message", 1, "pull-object"),  # round 1: its polls, then its train
                   (UP, "Receiving: train message", 2, "push-object")]  # round 2: its reply (~57 kB of adapter)
    node_log, proxy = wan_runs.node_log(1), wan_runs.proxies[1]
    before = {armed_at: logged_times(node_log, armed_at) for _, armed_at, _, _ in cuts_wanted}  # earlier runs' lines
    cuts_before = len(proxy.stats.cuts)
    with ThreadPoolExecutor(1) as background:
        try:
            for cid, tap in taps.items():
                wan_runs.proxies[cid].observer = tap
            proxy.links = {UP: UPLINK, DOWN: Link()}
            run = wan_runs.run(recipe, tmp_path / "run.log")
            for direction, armed_at, times, _ in cuts_wanted:
                wait_until(lambda: logged_times(node_log, armed_at) >= before[armed_at] + times,  # noqa: B023
                           600, f"{armed_at} ({times})", node_log, every_s=0.02)
                proxy.cut_after(direction, 16384)  # 16 kB into what node 1 sends or receives next
            # the simulation meanwhile (node 1's cuts are armed: nothing here waits on a log line any more)
            sim = background.submit(lambda: server.run(parse_recipe({**raw, "output_dir": str(tmp_path / "sim")})))
            assert run.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
        finally:
            wan_runs.fresh_links()
        cuts = proxy.stats.cuts[cuts_before:]
        sim_dir = sim.result().run_dir
    assert [c["direction"] for c in cuts] == [DOWN, UP], cuts
    sent = {d: {c: dict(t.bytes[d]) for c, t in taps.items()} for d in (UP, DOWN)}
    resent = {path: sent[d][1].get(path, 0) - sent[d][0].get(path, 0) for d, _, _, path in cuts_wanted}
    largest = {path: taps[0].largest(d, path) for d, _, _, path in cuts_wanted}
    (tmp_path / "resent.json").write_text(json.dumps({"sent": sent, "resent": resent, "largest_object": largest}))
    print(f"bytes by direction and path: {sent}; sent again to or by the cut node: {resent}; largest object: {largest}")
    # the object cut mid-request is sent again whole: more than nothing, at most one object (node 0 moves the same
    # objects uncut)
    for path, again in resent.items():
        assert 0 < again <= largest[path], (path, resent, largest)
    assert_matches(sim_dir, tmp_path / "flower-run", ["adapter"], "cut download and upload", exact=True)
