"""Client-parallel simulation over two CPU processes gives the single-process result.

Per-client state (optimizer moments, private factors, control variates) is gathered to every
process after each round, so a client trained by rank 1 in one round and by rank 0 in the next
continues from exactly what it kept (DESIGN.md §3).

Every two-process run of the session is a job of ONE torchrun launch (tests/distributed_jobs.py: the
same two gloo processes run the ``fedllm train`` commands one after another), started when the first
test needs it; each test computes its single-process reference meanwhile and waits only for its jobs.
The launch (tests/conftest.py's session fixture ``two_processes``) runs the jobs of every collected test that
uses it, in this module, tests/test_preference_distributed.py and tests/training/test_compression.py: each
such module queues its tests' jobs in ``two_process_jobs``.
Starting a launch (torchrun's agent, two processes importing torch, transformers and fedllm) costs ~15-16 CPU-s
before the first job, a launch per module paid it three times.
"""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fedllm.engine.server import RoundLoop, run
from fedllm.recipe.checks import parse_recipe
from tests.conftest import arith_records, crashing_round, tiny_raw, write_jsonl

LAUNCH_TIMEOUT_S = 2400  # a guard for every job of the launch together (~1 min idle, ~8 beside 4 busy loops)
JOBS_SCRIPT = Path(__file__).with_name("distributed_jobs.py")

# strategy, strategy_args, extra sections: each keeps per-client state across rounds. With 3 of 4 clients per round
# (seed 0: clients 0,1,2 in round 1, then 1,2,3; rank r trains sample[r::2]) clients 1 and 2 change ranks between
# rounds 1 and 2, so 2 rounds show the state following its client; a strategy with ``tau`` (2) runs 3 rounds, so
# the round after its every-tau step trains on every rank as well.
STATEFUL = {
    "fedavg": ("fedavg", {}, {}),
    # with activation checkpointing on every rank: FRLoRA's residual hooks recomputed (and in fedavg-dp-sgd,
    # opacus's recording paused in the recomputation)
    "frlora-moments": ("frlora", {}, {"train": {"optimizer_state": "per_client", "gradient_checkpointing": True}}),
    "pfedloru": ("pfedloru", {"personal_r": 2, "personal_steps": 1, "tau": 2}, {}),
    "scaffold": ("scaffold", {}, {}),
    "fedloru": ("fedloru", {"tau": 2, "reinit": "momentum"}, {"train": {"optimizer_state": "per_client"}}),
    "fedadam": ("fedadam", {"eta": 1e-2}, {}),
    "fedavg-packing": ("fedavg", {}, {"train": {"packing": True}}),  # each rank packs its clients' micro-batches
    # client-level DP around a server optimiser: the noise (fixed seed) and adaptive norm agree on every rank
    "fedadam-dp": ("fedadam", {"eta": 1e-2}, {"privacy": {"mechanism": "central", "noise_multiplier": 0.5,
                                                          "clipping_norm": 0.05, "noise_seed": 3, "per_client_stats": True,
                                                          "adaptive_clipping": {"enabled": True, "count_stddev": 1}}}),
    # DP-SGD: Poisson batches and noise seeded per (noise_seed, round, client), whichever rank trains the client
    "fedavg-dp-sgd": ("fedavg", {}, {"privacy": {"mechanism": "dp_sgd", "noise_multiplier": 0.8,
                                                 "clipping_norm": 0.5, "delta": 1e-3, "noise_seed": 5},
                                     "train": {"gradient_checkpointing": True}}),
    # secure aggregation (SecAgg+): every process runs the protocol's server steps on the exchanged messages, the
    # masked words are gathered like updates, and the seeded quantisation makes the unmasked sum the same
    "fedadam-secagg-dp": ("fedadam", {"eta": 1e-2}, {"privacy": {
        "secure_aggregation": "secagg_plus", "secagg": {"max_dropouts": 0}, "mechanism": "central_client_clipping",
        "noise_multiplier": 0.5, "clipping_norm": 0.05, "noise_seed": 3, "per_client_stats": True,
        "adaptive_clipping": {"enabled": True, "count_stddev": 1}}}),
    "pflmf": ("pflmf", {"rank": 3, "eta_u": 0.5}, {"train": {"optimizer_state": "per_client"}}),
    "fedsa_lora": ("fedsa_lora", {}, {"train": {"optimizer_state": "per_client"}}),
    "flora": ("flora", {"client_ranks": [4, 1, 2, 4]}, {}),
    "flexlora": ("flexlora", {"client_ranks": [4, 1, 2, 4]}, {}),
    # the server's per-client ranks (pruned on the clients) and the round's trained factor agree on every rank
    "hetlora": ("hetlora", {"client_ranks": [4, 1, 2, 4], "gamma": 0.5, "prune_lambda": 5.0},
                {"train": {"optimizer_state": "per_client"}}),
    "rolora": ("rolora", {}, {"train": {"optimizer_state": "per_client"}}),
    "lora_fair": ("lora_fair", {}, {}),
    # DP-SGD on B only; the server's SVD of B̄·A gives every rank the same orthonormal A
    "fedsvd-dp-sgd": ("fedsvd", {}, {"privacy": {"mechanism": "dp_sgd", "noise_multiplier": 0.8,
                                                 "clipping_norm": 0.5, "delta": 1e-3, "noise_seed": 5}}),
    # A and B go to a client once and stay in its per-client state, whichever rank trains it later
    "fed_sb": ("fed_sb", {}, {"train": {"optimizer_state": "per_client"}}),
    # DoRA: FedSA-LoRA's private magnitude follows its client; FlexLoRA's pieces inside DoRA's norm on every rank
    "fedsa_lora-dora": ("fedsa_lora", {}, {"lora": {"use_dora": True}}),
    "flexlora-dora": ("flexlora", {"client_ranks": [4, 1, 2, 4]}, {"lora": {"use_dora": True}}),
    # DoRA with every other strategy: merges into the base (FedEx-LoRA, FLoRA, mFedLoRU, pFedLoRU), private parts
    # after the DoRA layer (pFedLoRU, FedLoRA-PFL), m sliced from U·v (pFL^MF), m weighted by the layer's norms
    # (HetLoRA), refined or refactorised factors under the norm (LoRA-FAIR, FedSVD), the R hook (Fed-SB), alternation
    **{f"{name}-dora": (name, args, {"lora": {"use_dora": True}}) for name, args in (
        ("fedex_lora", {}), ("flora", {"client_ranks": [4, 1, 2, 4]}),
        ("mfedloru", {"tau": 2, "client_ranks": [4, 2, 1, 4]}), ("pfedloru", {"personal_r": 2, "personal_steps": 1,
                                                                             "tau": 2}),
        ("fedlora_pfl", {"e_lora": 1, "e_global": 1}), ("pflmf", {"rank": 3, "eta_u": 0.5}), ("lora_fair", {}))},
    # FedEx-LoRA with an nf4 download: every rank takes the residual against the factors' next download
    "fedex_lora-nf4": ("fedex_lora", {}, {}, {"compression": {"download": "nf4"}}),
    # ... and with an nf4 download on every rank: truncated factors sent exact (HetLoRA), the dequantised frozen
    # factor kept by the server (RoLoRA, FedSVD), A and B sent exact once (Fed-SB)
    **{f"{name}-dora-nf4": (name, args, {"lora": {"use_dora": True}}, {"compression": {"download": "nf4"}})
       for name, args in (("hetlora", {"client_ranks": [4, 1, 2, 4], "gamma": 0.5, "prune_lambda": 5.0}),
                          ("rolora", {}), ("fedsvd", {}), ("fed_sb", {}))},
}
RESUMED = ["frlora-moments", "scaffold"]  # checkpointed by 1 process and resumed by 2, and the reverse


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stateful_raw(case: str, out, data, **extra) -> dict:
    strategy, args, sections, *federation = STATEFUL[case]  # (federation: extra keys of that section)
    rounds = 3 if "tau" in args else 2
    return tiny_raw(out, data, federation={"num_clients": 4, "clients_per_round": 3, "rounds": rounds,
                                           "strategy": strategy, "strategy_args": args, **(federation or [{}])[0]},
                    **sections, **extra)


class TwoProcessLaunch:
    """``fedllm train`` jobs run by one torchrun launch of 2 gloo processes (``OMP_NUM_THREADS=1``)."""

    def __init__(self, root: Path):
        self.root = root
        self.data = write_jsonl(root / "arith.jsonl", arith_records(48))
        self.jobs: dict[str, list[str]] = {}
        self.raws: dict[str, dict] = {}
        self.proc: subprocess.Popen | None = None

    def add(self, name: str, raw: dict, *options: str) -> None:
        """Queue ``fedllm train`` of ``raw`` into ``root/name`` (``options``: e.g. ``--resume``)."""
        raw = {**raw, "output_dir": str(self.root / name)}
        path = self.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw))
        self.jobs[name], self.raws[name] = ["train", str(path), *options], raw

    def recipe(self, name: str, output_dir) -> dict:
        """Job ``name``'s raw recipe, writing to ``output_dir`` instead (for the single-process reference)."""
        return {**self.raws[name], "output_dir": str(output_dir)}

    def start(self) -> None:
        (self.root / "jobs.json").write_text(json.dumps(self.jobs))
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.log = self.root / "launch.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([torchrun, "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                                          "--master_port", str(free_port()), str(JOBS_SCRIPT),
                                          str(self.root / "jobs.json"), str(self.root)],
                                         stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.deadline = time.monotonic() + LAUNCH_TIMEOUT_S

    def run_dir(self, name: str) -> Path:
        """The run directory of job ``name`` once both processes finished it with exit code 0."""
        codes = [self.root / f"{name}.rank{r}.rc" for r in (0, 1)]
        while not all(c.is_file() for c in codes) and self.proc.poll() is None:  # the ranks write these last
            if time.monotonic() > self.deadline:
                self.stop()
                pytest.fail(f"{name}: not done within {LAUNCH_TIMEOUT_S}s\n{self.log_of(name)}")
            time.sleep(0.2)
        got = [c.read_text() if c.is_file() else None for c in codes]
        assert got == ["0", "0"], f"{name}: exit codes {got}\n{self.log_of(name)}"
        return self.root / name

    def log_of(self, name: str) -> str:
        text = self.log.read_text()
        at = text.find(f"@@JOB@@ {name}:")
        return text[at:at + 4000] if at >= 0 else text[-4000:]

    def stop(self) -> None:
        """Wait for the processes to exit once every job is done (each rank wrote its exit code); else kill them."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if all((self.root / f"{name}.rank{r}.rc").is_file() for name in self.jobs for r in (0, 1)):
            with contextlib.suppress(subprocess.TimeoutExpired):  # only the process group's teardown is left
                self.proc.wait(timeout=60)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


def shared_launch(request) -> TwoProcessLaunch:
    """The session's one :class:`TwoProcessLaunch` (tests/conftest.py's ``two_processes``), started: the jobs of
    every collected test that uses the ``two_processes`` fixture, queued by its module's
    ``two_process_jobs(launch, tests)`` in collection order (so the first tests' jobs are done first)."""
    launch = TwoProcessLaunch(request.getfixturevalue("tmp_path_factory").mktemp("two-processes"))
    by_module: dict = {}
    for item in request.session.items:
        if "two_processes" in getattr(item, "fixturenames", ()):
            by_module.setdefault(item.module, []).append(item)
    for module, tests in by_module.items():
        module.two_process_jobs(launch, tests)
    launch.start()
    return launch


def two_process_jobs(launch: TwoProcessLaunch, tests: list) -> None:
    """Queue the jobs of this module's ``tests`` (see :func:`shared_launch`)."""
    for test in tests:
        case = test.callspec.params.get("case") if hasattr(test, "callspec") else None
        if test.originalname == "test_two_processes_match_one":  # FedAvg: the job of the stateful case
            launch.add("stateful-fedavg", stateful_raw("fedavg", "-", launch.data))
        elif test.originalname == "test_per_client_state_follows_the_client_across_processes":
            launch.add(f"stateful-{case}", stateful_raw(case, "-", launch.data))
        elif test.originalname == "test_resume_with_a_different_number_of_processes":
            raw = stateful_raw(case, "-", launch.data, checkpoint={"every": 1})
            # 1 -> 2: one process crashes in the last round (the one before is checkpointed); two processes resume it
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(RoundLoop, "run_round", crashing_round(RoundLoop.run_round, raw["federation"]["rounds"]))
                with pytest.raises(RuntimeError, match="power cut"):
                    run(parse_recipe({**raw, "output_dir": str(launch.root / f"one-then-two-{case}")}))
            launch.add(f"one-then-two-{case}", raw, "--resume")
            # 2 -> 1: a two-process run, cut and resumed by one process in the test
            launch.add(f"two-then-one-{case}", raw)



def final_tensors(run_dir) -> dict[str, dict[str, torch.Tensor]]:
    return {part: load_file(str(p)) for part in ("adapter", "base", "strategy", "clients")
            if (p := run_dir / "final" / f"{part}.safetensors").is_file()}


def assert_same(single: dict, other: dict, tol: float = 1e-6) -> None:
    assert single.keys() == other.keys()
    for part, tensors in single.items():
        assert tensors.keys() == other[part].keys(), part
        worst = max((float((tensors[k] - other[part][k]).abs().max()) for k in tensors), default=0.0)
        assert worst <= tol, f"{part}: max abs difference {worst}"


def test_two_processes_match_one(two_processes, tmp_path):
    single = run(parse_recipe(two_processes.recipe("stateful-fedavg", tmp_path / "one")))
    two = two_processes.run_dir("stateful-fedavg")
    a = load_file(str(single.run_dir / "final" / "adapter.safetensors"))
    b = load_file(str(two / "final" / "adapter.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = (two / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2  # only rank 0 writes
    counted = ("tokens", "supervised_tokens", "positions", "flops")  # throughput: rank 1's clients count too
    assert [[json.loads(x)["throughput"][k] for k in counted] for x in lines] == \
        [[h["throughput"][k] for k in counted] for h in single.history]


@pytest.mark.parametrize("case", sorted(STATEFUL))
def test_per_client_state_follows_the_client_across_processes(case, two_processes, tmp_path):
    one = run(parse_recipe(two_processes.recipe(f"stateful-{case}", tmp_path / "one")))
    two = two_processes.run_dir(f"stateful-{case}")
    assert_same(final_tensors(one.run_dir), final_tensors(two))
    if "privacy" in STATEFUL[case][2]:  # the same epsilon (and per-client epsilons) in every round's metrics line
        lines = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
        for key in ("epsilon", "client_epsilon"):
            assert [h.get(key) for h in lines] == [h.get(key) for h in one.history], key
        assert lines[-1]["epsilon"] > 0
    if len(STATEFUL[case]) > 3:  # a compressed download: the same bytes (codes + absmax, exact tensors) per client
        lines = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
        assert [h["bytes_down"] for h in lines] == [h["bytes_down"] for h in one.history]


@pytest.mark.parametrize("case", RESUMED)
def test_resume_with_a_different_number_of_processes(case, two_processes, tmp_path):
    """A run checkpointed by 1 process resumes on 2, and one checkpointed by 2 resumes on 1: same final state."""
    single = final_tensors(run(parse_recipe(two_processes.recipe(f"two-then-one-{case}", tmp_path / "one"))).run_dir)
    rounds = two_processes.raws[f"two-then-one-{case}"]["federation"]["rounds"]
    # 1 -> 2: one process crashed in the last round (the one before is checkpointed); two processes resumed it
    assert_same(single, final_tensors(two_processes.run_dir(f"one-then-two-{case}")))
    # 2 -> 1: a two-process run cut after the round before the last (its last round's results removed); one
    # process resumes it
    cut = two_processes.run_dir(f"two-then-one-{case}")
    shutil.rmtree(cut / "final")
    resumed = run(parse_recipe(two_processes.recipe(f"two-then-one-{case}", cut)), resume=True)
    assert_same(single, final_tensors(resumed.run_dir))
    assert [h["round"] for h in resumed.history if h.get("round")] == list(range(1, rounds + 1))


def test_pack_unpack_round_trips_every_dtype_and_shape():
    from fedllm.engine.distributed import pack, unpack

    tensors = [torch.randn(3, 4), torch.randn(5).to(torch.bfloat16), torch.tensor(7.0), torch.tensor([True, False]),
               torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.empty(0, 4), torch.randn(2, 3).t()]
    buffer, layout = pack(tensors)
    assert buffer.dtype == torch.uint8 and buffer.numel() == sum(t.numel() * t.element_size() for t in tensors)
    back = unpack(buffer, layout)
    assert all(b.dtype == t.dtype and b.shape == t.shape and torch.equal(b, t) for b, t in zip(back, tensors,
                                                                                               strict=True))
