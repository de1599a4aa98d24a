"""The Flower deployment this folder's deployment tests share (tests/conftest.py puts them in one xdist group)."""

import pytest

from tests.flower_wan.wan_cluster import WanRuns, wan_deployment


@pytest.fixture(scope="package")
def wan_runs(tmp_path_factory):
    """A SuperLink and 3 SuperNodes, each behind its own WAN proxy, started once for test_flower_cut and
    test_flower_deadline (each runs on it in turn) and stopped after the last test of this folder."""
    root = tmp_path_factory.mktemp("wan")
    with wan_deployment(root, 3, runs_dir=tmp_path_factory.getbasetemp()) as (port, proxies, _, launch):
        yield WanRuns(root, port, proxies, launch)
