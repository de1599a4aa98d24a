"""Shared fixtures: offline, CPU, tiny models, data the tests write themselves."""

import atexit
import contextlib
import json
import os
import random
import shutil
import tempfile

import pytest

from tests.stop_on_interrupt import pytest_configure, pytest_keyboard_interrupt  # noqa: F401 (Ctrl-C ends every process)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# one CPU thread per test process (and the processes it starts): on tiny models a second OpenMP thread
# buys nothing and, on a shared machine, spins for 2-4x the CPU seconds. Set before torch loads; a test
# that needs other counts sets them itself (tests/cli/test_threads.py); pytest-xdist runs tests side by side.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the tokenized-data cache of the test session (never the user's ~/.cache), removed when the session ends
if "FEDLLM_CACHE_DIR" not in os.environ:
    os.environ["FEDLLM_CACHE_DIR"] = tempfile.mkdtemp(prefix="fedllm-test-cache-")
    atexit.register(shutil.rmtree, os.environ["FEDLLM_CACHE_DIR"], ignore_errors=True)

OPS = {"add": ("+", lambda a, b: a + b), "sub": ("-", lambda a, b: a - b), "mul": ("*", lambda a, b: a * b)}


def arith_records(n: int, seed: int = 0) -> list[dict]:
    """Tiny GSM8K-format records with a category column."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        cat = rng.choice(sorted(OPS))
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        sym, fn = OPS[cat]
        out.append({"question": f"What is {a} {sym} {b}?", "answer": f"{a} {sym} {b} = {fn(a, b)}\n#### {fn(a, b)}",
                    "category": cat})
    return out


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def load_script(path, name: str | None = None):
    """A script of the repository (``bench/``, ``data_prep/``, ``eval/``) imported as a module, to test its parts."""
    import importlib.util
    from pathlib import Path

    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def arith_file(tmp_path):
    return write_jsonl(tmp_path / "arith.jsonl", arith_records(48))


@pytest.fixture
def ragged_file(tmp_path):
    """48 instruction records whose prompts run from 1 to 40 filler words (so batches carry padding)."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "sum", "of", "the", "numbers"]
    records = []
    for i in range(48):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        filler = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        records.append({"question": f"{filler} what is {a} + {b}?", "answer": f"{a} + {b} = {a + b}"})
    path = tmp_path / "ragged.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def tiny_raw(output_dir, data_path, /, **sections) -> dict:
    """A raw recipe dict for a tiny LLaMA on ``data_path`` (2 rounds, 3 clients, 2 per round); each keyword
    section is merged into the default one of that name (or replaces it when not a dict: ``output_dir=...``)."""
    raw = {
        "seed": 0, "output_dir": str(output_dir),
        "model": {"name": "tiny-llama"}, "lora": {"r": 4, "alpha": 8},
        "data": {"path": str(data_path), "format": "instruction",
                 "fields": {"instruction": "question", "output": "answer"}},
        "federation": {"num_clients": 3, "clients_per_round": 2, "rounds": 2,
                       "partition": {"method": "iid"}},
        # fp32 pinned: tests compare exact values (train.dtype: auto would pick bf16 on a CPU with avx512_bf16)
        "train": {"local_steps": 2, "batch_size": 4, "lr": 1e-2, "max_length": 64, "dtype": "fp32"},
        "logging": {"progress": False, "quiet": True},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return raw


@pytest.fixture
def tiny_recipe(tmp_path, arith_file):
    """A raw recipe dict for a tiny LLaMA on the arith fixture (2 rounds, 3 clients, 2 per round)."""

    def make(**sections):
        return tiny_raw(tmp_path / "run", arith_file, **sections)

    return make


# ----- pytest-xdist: README's test command runs the suite on two workers (`-n 2`; setup.cfg adds `--dist loadgroup
# --no-loadscope-reorder`). Each test file is one group, run whole by one worker, so its module fixtures are built
# once; files that share a costly session fixture form one group. The groups known to be long are sent first, so
# that no long group is left to run alone at the end. (pytest-xdist 3.8's own loadgroup reads xdist_group marks into
# `item._nodeid`, which pytest 9.2 no longer uses for the node id: its groups never formed. These hooks use only
# the documented scheduler hook and the collection order.)
SHARED_GROUPS = {
    "tests/test_flower_deployment.py": "flower-deployment",  # one SuperLink + SuperNodes (tests/flower_cluster.py)
    "tests/test_flower_security.py": "flower-deployment",
    "tests/test_flower_secagg_deployment.py": "flower-deployment",
    "tests/test_quickstart.py": "smollm2",  # the session's one SmolLM2 GGUF conversion (smollm2_first_load)
    "tests/test_preference_quickstart.py": "smollm2",
    "tests/test_gguf_cache.py": "smollm2",
    "tests/meta/test_tokenizer_memory.py": "smollm2",
    "tests/reliability/test_offline_presets.py": "smollm2",
    "tests/flower_wan/test_flower_cut.py": "flower-wan",  # one proxied deployment (tests/flower_wan/conftest.py)
    "tests/flower_wan/test_flower_deadline.py": "flower-wan",
    "tests/flower_wan/test_object_round_trips.py": "flower-wan",
    # the sandbox tests check that no sandboxed process or scratch directory is left: no other sandbox beside them
    "tests/evaluation/test_flowertune_sandbox.py": "flowertune-sandbox",
    "tests/evaluation/test_flowertune_protocols.py": "flowertune-sandbox",
    "tests/evaluation/test_flowertune_tasks.py": "flowertune-sandbox",
    "tests/evaluation/test_flowertune_python_harness.py": "flowertune-sandbox",
    # the session's one torchrun launch of 2 processes (tests/test_distributed.py's shared_launch)
    "tests/test_preference_distributed.py": "tests/test_distributed.py",
    "tests/training/test_compression.py": "tests/test_distributed.py",
}
SHARED_PREFIXES = {"tests/export/": "export"}  # the exported runs of tests/export/conftest.py (`cases`)
LONG_GROUPS_FIRST = ("flower-deployment", "smollm2", "tests/test_flower_readme.py", "tests/meta/test_meta_gemma3.py",
                     "tests/evaluation/test_eval_harness.py", "tests/test_distributed.py", "tests/test_flower_apps.py",
                     "flower-wan",
                     "export", "tests/strategies/test_e2e.py", "tests/cli/test_cli_startup.py")


def xdist_group(nodeid: str) -> str:
    """The pytest-xdist group of a test: its file (relative to the repository), or the group sharing its fixture."""
    path = nodeid.split("::", 1)[0]
    for prefix, group in SHARED_PREFIXES.items():
        if path.startswith(prefix):
            return group
    return SHARED_GROUPS.get(path, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        """Whole groups (:func:`xdist_group`) to a worker, in collection order."""

        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return FileGroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: every worker collects, and sends, this order
        rank = {group: i for i, group in enumerate(LONG_GROUPS_FIRST)}
        items.sort(key=lambda item: rank.get(xdist_group(item.nodeid), len(rank)))  # stable: the rest keep theirs


@pytest.fixture(scope="session", autouse=True)
def _no_plot_png():
    """The in-process runs of the suite (several hundred) skip plot.png: matplotlib's layout and PNG cost ~0.5
    CPU-s a run, a third of a tiny run, and play no part in what those tests check. The tests of plot.png
    restore it with :func:`plot_png`; runs in subprocesses (CLI, torchrun, Flower) always draw it."""
    import fedllm.engine.server

    def skip(run_dir):
        return None

    skip.real = fedllm.engine.server.write_run_plot
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fedllm.engine.server, "write_run_plot", skip)
        yield


@contextlib.contextmanager
def plot_png():
    """Runs started in the ``with`` block write their plot.png (see :func:`_no_plot_png`)."""
    import fedllm.engine.server

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fedllm.engine.server, "write_run_plot", getattr(fedllm.engine.server.write_run_plot, "real",
                                                               fedllm.engine.server.write_run_plot))
        yield


@pytest.fixture
def crash_at_round(monkeypatch):
    """``crash_at_round(n)`` makes the round loop raise ``RuntimeError('power cut')`` in round ``n``;
    ``crash_at_round(None)`` restores it (for the resume that follows)."""
    from fedllm.engine.server import RoundLoop

    original = RoundLoop.run_round

    def arm(rnd):
        monkeypatch.setattr(RoundLoop, "run_round", original if rnd is None else crashing_round(original, rnd))

    return arm


def cut_and_resume(recipe, crash_at_round, rnd: int = 2):
    """Run ``recipe`` with a power cut in round ``rnd`` (its last checkpoint must then be round ``rnd - 1``), then
    resume it; the resumed run's result."""
    from pathlib import Path

    from fedllm.engine.server import run
    from fedllm.runs import checkpoint as ckpt_io

    crash_at_round(rnd)
    with pytest.raises(RuntimeError, match="power cut"):
        run(recipe)
    assert ckpt_io.latest_checkpoint(Path(recipe.output_dir)).name == f"round-{rnd - 1:04d}"
    crash_at_round(None)
    return run(recipe, resume=True)


def crashing_round(original, rnd: int):
    """``RoundLoop.run_round`` that raises ``RuntimeError('power cut')`` in round ``rnd`` (``original`` otherwise)."""

    def crash(self, r, bar):
        if r == rnd:
            raise RuntimeError("power cut")
        return original(self, r, bar)

    return crash


@pytest.fixture(scope="session")
def two_processes(request):
    """The session's one torchrun launch of 2 gloo processes, running the jobs of every collected test that uses
    this fixture (tests/test_distributed.py's ``shared_launch``)."""
    from tests.test_distributed import shared_launch

    launch = shared_launch(request)
    yield launch
    launch.stop()


@pytest.fixture(scope="session")
def smollm2_first_load(tmp_path_factory):
    """The session's first load of the real SmolLM2 preset (slow tests), observed: the GGUF converted into the
    session's cache, which the later SmolLM2 loads of the session read instead of converting again (each
    conversion costs tens of CPU-seconds). When the cache was filled before (another pytest-xdist worker),
    the observed load goes to a cache of its own. Returns what transformers was asked to read, the tokenizer,
    a sha256 per tensor of the loaded model, its generation config and the cache used."""
    from types import SimpleNamespace

    import transformers

    from fedllm.common.registry import model_presets
    from fedllm.models import gguf_cache
    from fedllm.models.loading import load_base_model, load_tokenizer
    from fedllm.recipe.schema import ModelConfig

    cfg = ModelConfig(name="smollm2-135m-instruct")
    directory, gguf = model_presets.get(cfg.name).location()
    cache = os.environ["FEDLLM_CACHE_DIR"]
    if gguf_cache.model_dir(directory, gguf) is not None:
        cache = str(tmp_path_factory.mktemp("smollm2-cache"))
    sources, parses = [], []
    original = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, name, *args, **kwargs):
        sources.append(kwargs.get("gguf_file") or name)
        return original(cls, name, *args, **kwargs)

    import gguf as gguf_package

    real_reader = gguf_package.GGUFReader

    def counted_reader(path, *args, **kwargs):
        parses.append(str(path))
        return real_reader(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDLLM_CACHE_DIR", cache)
        mp.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(spy))
        mp.setattr(gguf_package, "GGUFReader", counted_reader)
        with gguf_cache.one_parse_per_file():  # as fedllm's runs load a model: tokenizer, config, weights
            tokenizer = load_tokenizer(cfg)
            model = load_base_model(cfg, tokenizer)
    return SimpleNamespace(cfg=cfg, directory=directory, gguf=gguf, cache=cache, sources=sources, tokenizer=tokenizer,
                           digests=tensor_digests(model), generation_config=model.generation_config.to_dict(),
                           parses=parses)


@pytest.fixture(scope="session")
def smollm2_quickstart_run(smollm2_first_load, tmp_path_factory):
    """README's quickstart as written (``python data_prep/make_arith.py --out data/arith && fedllm train
    recipes/quickstart/smollm2-arith-fedavg.yaml``, here with ``output_dir=run``), run once for the session's tests
    that need a finished SmolLM2 run: tests/test_quickstart.py checks what it reports,
    tests/reliability/test_offline_presets.py exports its adapter and reloads it offline. Returns ``code`` (the
    exit code of ``fedllm train``), ``printed`` (its stdout) and ``run_dir``."""
    import io
    import subprocess
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from fedllm.commands.cli import main

    root = Path(__file__).resolve().parents[1]
    where = tmp_path_factory.mktemp("quickstart")
    subprocess.run([sys.executable, str(root / "data_prep" / "make_arith.py"), "--out", str(where / "data" / "arith")],
                   check=True)
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.chdir(where)  # the recipe's data paths are relative to where it is launched
        code = main(["train", str(root / "recipes" / "quickstart" / "smollm2-arith-fedavg.yaml"), "output_dir=run"])
    return SimpleNamespace(code=code, printed=printed.getvalue(), run_dir=where / "run")


def tensor_digests(model) -> dict:
    """dtype and sha256 of every tensor of ``model``'s state dict (bit-for-bit comparisons without a copy)."""
    import hashlib

    import torch

    return {k: (str(v.dtype), hashlib.sha256(v.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest())
            for k, v in model.state_dict().items()}


def release_freed_memory() -> None:
    """Hand the heap pages this process has freed back to the system (glibc's ``malloc_trim``; elsewhere nothing).
    A test file that loads a real model (SmolLM2: a 2.5 GB peak) leaves its xdist worker at 1.6 GB of RSS after
    everything it held is freed: glibc keeps the freed pages, and the worker then carries them through every later
    file. Measured: 1,605 MB -> 616 MB after ``tests/reliability/test_offline_presets.py``."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to hand back
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """At the end of each test file, after its fixtures are finalized: :func:`release_freed_memory`; with ``FEDLLM_TESTS_MEMORY_LOG=FILE``, append
    ``worker file RSS-now-MB peak-RSS-MB`` of this process (an xdist worker, or the one pytest process) to FILE, to
    find the files that hold more memory than they need (the suite runs beside other jobs on a 23 GB machine)."""
    yield
    if nextitem is not None and nextitem.path == item.path:
        return
    release_freed_memory()
    where = os.environ.get("FEDLLM_TESTS_MEMORY_LOG")
    if not where:
        return
    import resource
    from pathlib import Path

    now = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(where, "a") as log:
        log.write(f"{worker} {item.path.relative_to(item.config.rootpath)} {now} {peak}\n")
