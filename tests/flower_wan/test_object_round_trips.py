"""A real Flower deployment, node 0 150 ms each way from its SuperLink: each train message's objects are pulled in
one round trip (fedllm/flower/object_concurrency.py), where Flower's 2 at a time took N/2 (3 for the 6 objects of a
message here); its reply's are pushed at Flower's 2 at a time. Read from the proxy's request log
(fedllm/flower/request_log.py), not from wall times: a request that leaves after another's answer came back counts one
round trip more."""

import pytest
import yaml

from fedllm.flower.request_log import RequestLog, transfers
from fedllm.flower.wan_proxy import DOWN, UP, Link

ONE_WAY_MS = 150.0


@pytest.mark.slow
def test_a_message_s_objects_cost_one_round_trip_each_way(tiny_recipe, tmp_path, wan_runs):
    raw = tiny_recipe(federation={"num_clients": 3, "clients_per_round": 3, "rounds": 2})
    raw["output_dir"] = str(tmp_path / "flower-run")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    proxy = wan_runs.proxies[0]
    log = RequestLog(proxy)
    try:
        proxy.links = {UP: Link(ONE_WAY_MS), DOWN: Link(ONE_WAY_MS)}
        # no TCP handshake: a connection opened again for a message (Flower's HTTP client keeps its idle connections
        # 5 s) would add one round trip to its objects, before and after alike; bench/wan_objects.py counts it
        proxy.handshake, proxy.observer = False, log
        run = wan_runs.run(recipe, tmp_path / "run.log")
        assert run.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        wan_runs.fresh_links()
    moved = transfers(log.take())[2:]  # the discovery query (with the run's get-run and get-fab) left out
    print([(t.kind, t.objects, t.round_trips, t.object_round_trips, round(t.seconds, 2)) for t in moved])
    assert [t.kind for t in moved] == ["receive", "send"] * 2, moved  # each round's train message and reply
    for t in moved:
        assert t.objects >= 5, t
        if t.kind == "receive":
            # Flower's 2 at a time: ceil(N / 2) >= 3 round trips for these N >= 5 objects; all at once: 1 (2 allowed
            # for a thread that starts late on a loaded machine, still below N / 2)
            assert t.object_round_trips <= 2 < t.objects / 2, t
            # the whole message: the poll that returns it, its objects, its confirmation (Flower: 1 + 3 + 1)
            assert t.round_trips <= 4, t
        else:  # the reply's objects go at Flower's 2 at a time (fedllm.flower.object_concurrency.FEDLLM_DEFAULTS)
            assert t.object_round_trips <= -(-t.objects // 2) + 1, t
