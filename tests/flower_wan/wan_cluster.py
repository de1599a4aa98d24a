"""A loopback Flower deployment whose SuperNodes reach the SuperLink through WAN proxies (tests of this folder)."""

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from fedllm.flower.wan_proxy import Link, WanProxy, running
from tests.flower_cluster import env_for, free_port, port_open, start, stop, stop_all, wait_until


@contextmanager
def wan_deployment(tmp_path, clients: int, observers=None, runs_dir=None, node_env=None):
    """An insecure SuperLink and ``clients`` worker SuperNodes, each behind its own :class:`WanProxy` (loopback
    links until a test changes them); yields ``(superlink port, proxies, env, start_process)``, stops it all after.
    Runs may write inside ``runs_dir`` (default ``tmp_path``); ``node_env``: client -> variables of its SuperNode."""
    env = env_for(tmp_path / "flwr-home")
    port = free_port()
    procs = []

    def launch(args, log, extra_env=None):
        procs.append(start(args, tmp_path / log, {**env, **(extra_env or {})}))  # an absolute log path stays
        return procs[-1]

    try:
        launch(["flower", "superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port), "--runs-dir",
                str(runs_dir or tmp_path)], "superlink.log")
        wait_until(lambda: port_open(port), 120, "SuperLink listening", tmp_path / "superlink.log")
        with ExitStack() as stack:
            proxies = [stack.enter_context(running(WanProxy(("127.0.0.1", port),
                                                             observer=(observers or {}).get(c))))
                       for c in range(clients)]
            for cid, proxy in enumerate(proxies):
                launch(["flower", "supernode", "--superlink", f"127.0.0.1:{proxy.address[1]}", "--client", str(cid),
                        "--insecure", "--state-dir", str(tmp_path / "state"), "--port", str(free_port())],
                       f"supernode{cid}.log", (node_env or {}).get(cid))
            yield port, proxies, env, launch
    finally:
        stop_all(procs[:0:-1])  # the SuperNodes and the run at once, then the SuperLink
        for p in procs[:1]:
            stop(p)


@dataclass
class WanRuns:
    """One :func:`wan_deployment` that the tests of this folder share (tests/flower_wan/conftest.py): each starts
    its own run on it and leaves the proxies as it found them (:meth:`fresh_links`)."""

    root: Path
    port: int
    proxies: list
    launch: object

    def node_log(self, cid: int) -> Path:
        return self.root / f"supernode{cid}.log"

    def fresh_links(self) -> None:
        """Loopback links, TCP's handshake and no observer on every proxy (a test's slow link or tap gone)."""
        for proxy in self.proxies:
            proxy.links = {direction: Link() for direction in proxy.links}
            proxy.handshake, proxy.observer = True, None

    def run(self, recipe: Path, log: Path):
        """``fedllm flower run RECIPE`` on this deployment, logging to ``log``."""
        return self.launch(["flower", "run", str(recipe), "--superlink", f"127.0.0.1:{self.port}", "--insecure",
                            "--timeout", "600"], log)


def logged_times(path, text) -> int:
    """How many times ``text`` is in the log ``path`` (0 before it exists)."""
    return path.read_text(errors="replace").count(text) if path.is_file() else 0
