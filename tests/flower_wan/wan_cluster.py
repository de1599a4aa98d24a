"""A loopback Flower deployment whose SuperNodes reach the SuperLink through WAN proxies (tests of this folder)."""

from contextlib import ExitStack, contextmanager

from fedllm.flower.wan_proxy import WanProxy, running
from tests.flower_cluster import env_for, free_port, port_open, start, stop, stop_all, wait_until


@contextmanager
def wan_deployment(tmp_path, clients: int, observers=None):
    """An insecure SuperLink and ``clients`` worker SuperNodes, each behind its own :class:`WanProxy` (loopback
    links until a test changes them); yields ``(superlink port, proxies, env, start_process)``, stops it all after."""
    env = env_for(tmp_path / "flwr-home")
    port = free_port()
    procs = []

    def launch(args, log):
        procs.append(start(args, tmp_path / log, env))
        return procs[-1]

    try:
        launch(["flower", "superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port), "--runs-dir",
                str(tmp_path)], "superlink.log")
        wait_until(lambda: port_open(port), 120, "SuperLink listening", tmp_path / "superlink.log")
        with ExitStack() as stack:
            proxies = [stack.enter_context(running(WanProxy(("127.0.0.1", port),
                                                             observer=(observers or {}).get(c))))
                       for c in range(clients)]
            for cid, proxy in enumerate(proxies):
                launch(["flower", "supernode", "--superlink", f"127.0.0.1:{proxy.address[1]}", "--client", str(cid),
                        "--insecure", "--state-dir", str(tmp_path / "state"), "--port", str(free_port())],
                       f"supernode{cid}.log")
            yield port, proxies, env, launch
    finally:
        stop_all(procs[:0:-1])  # the SuperNodes and the run at once, then the SuperLink
        for p in procs[:1]:
            stop(p)
