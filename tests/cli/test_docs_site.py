"""The docs site cannot drift from the code or lose what README said: the generated references equal what the code
gives, the tutorials' commands are run (here or by the test named for their page) unless marked as needing a GPU or
the network, every heading of the old 882-line README still leads somewhere, the version is one number everywhere,
and the "add a strategy" guide's code runs as written. (`.ci/run` builds the site itself with `mkdocs build
--strict`: a broken link, a missing page or an API reference that does not resolve fails CI.)"""

from __future__ import annotations

import configparser
import re
import shlex
import subprocess
import sys

import pytest

from tests.cli.conftest import ROOT
from tests.cli.test_readme_promises import blocks, github_anchors
from tests.conftest import load_script

DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text(encoding="utf-8")

#: Every heading of README before it was cut to a front door (882 lines, 0.1.0), and where each now leads.
OLD_README_SECTIONS = {
    "set-up": "docs/tutorials/first-run.md",
    "your-own-data": "docs/tutorials/own-data.md",
    "which-strategy-should-i-pick": "docs/how-to/choose-a-strategy.md",
    "one-gpu": "docs/how-to/gpus.md",
    "recipes": "docs/reference/recipes.md",
    "cli": "docs/reference/cli.md",
    "from-one-laptop-to-n-gpus-to-m-machines": "docs/tutorials/flower-federation.md",
    "algorithms": "docs/reference/algorithms.md",
    "preference-alignment-dpo-and-its-family": "docs/tutorials/dpo.md",
    "results": "docs/measurements/results.md",
    "layout": "docs/DESIGN.md",
}

#: Tutorial pages whose commands a test (or CI) runs, and a string that test's file holds to show it reads that
#: page or runs that exact recipe. A tutorial command outside these pages must sit in a block marked
#: ``<!-- needs: ... -->`` (a GPU, the network, hours).
RUN_BY = {
    "first-run.md": ("tests/cli/test_docs_site.py", "test_first_run_commands_are_readmes"),
    "own-data.md": ("tests/cli/test_readme_promises.py", "docs/tutorials/own-data.md"),
    "flower-federation.md": ("tests/test_flower_readme.py", "docs/tutorials/flower-federation.md"),
    "privacy.md": ("tests/cli/test_docs_site.py", "test_privacy_tutorial_commands_run"),
    "dpo.md": ("tests/test_preference_quickstart.py", "smollm2-arith-dpo.yaml"),
    "reproduce-a-paper.md": ("tests/meta/test_meta_dry_run.py", "llama2-7b-alpaca-gpt4-frlora.yaml"),
}


def test_generated_references_equal_what_the_code_gives():
    """docs/reference/recipe-keys.md and cli.md are what docs/gen_reference.py writes from the schema and argparse."""
    gen = load_script(DOCS / "gen_reference.py")
    assert gen.main(["--check"]) == 0, "run: python docs/gen_reference.py"
    keys = (DOCS / "reference" / "recipe-keys.md").read_text()
    assert "| `train.lr` |" in keys and "| `privacy.secagg.neighbours` |" in keys
    assert "## `fedllm flower supernode`" in (DOCS / "reference" / "cli.md").read_text()


def test_a_schema_key_missing_from_the_reference_is_caught(tmp_path, monkeypatch):
    """--check fails when the page on disk lacks a key the schema has (the drift it exists to catch)."""
    gen = load_script(DOCS / "gen_reference.py")
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    (tmp_path / "docs" / "reference").mkdir(parents=True)
    for page in gen.PAGES:
        text = (DOCS / "reference" / page).read_text()
        (tmp_path / "docs" / "reference" / page).write_text(text.replace("| `train.lr` |", "| `train.lr_` |"))
    assert gen.main(["--check"]) == 1


def test_every_old_readme_section_still_leads_somewhere():
    """Each heading of the old README is still a heading of README (GitHub anchors keep working), and that section
    links to the docs page its content moved to."""
    anchors = github_anchors(README)
    for anchor, page in OLD_README_SECTIONS.items():
        assert anchor in anchors, anchor
        assert (ROOT / page).is_file(), page
    for title in ("Your own data", "One GPU", "Recipes", "Algorithms", "Results"):
        start = README.index(f"\n## {title}\n")
        text = README[start:README.index("\n## ", start + 1)]
        target = OLD_README_SECTIONS[next(a for a in OLD_README_SECTIONS if a == github_anchor(title))]
        assert target.removeprefix("docs/") in text or target in text, (title, target)


def github_anchor(title: str) -> str:
    return next(iter(github_anchors(f"# {title}\n")))


def test_readme_is_a_front_door():
    """≤ 250 lines, both set-up commands within the first 60, and the commands identical to .ci/run's."""
    lines = README.splitlines()
    assert len(lines) <= 250
    head = "\n".join(lines[:60])
    assert "fedllm train recipes/quickstart/smollm2-arith-fedavg.yaml" in head and "python -m pytest -q -n 2" in head


def test_first_run_commands_are_readmes():
    """The first-run tutorial's set-up and test commands are README's word for word (which CI runs)."""
    tutorial = (DOCS / "tutorials" / "first-run.md").read_text()
    readme_lines = {line for block in blocks(README, "bash") for line in block.splitlines()}
    for line in blocks(tutorial, "bash")[0].splitlines() + blocks(tutorial, "bash")[1].splitlines() + \
            blocks(tutorial, "bash")[2].splitlines():
        assert line in readme_lines, line


def test_every_tutorial_command_is_run_or_marked():
    """Every tutorial with a command is run by the test named in RUN_BY (its file holds the page or recipe it
    runs), or the block says what it needs (``<!-- needs: ... -->`` right above it)."""
    for page in sorted((DOCS / "tutorials").glob("*.md")):
        text = page.read_text()
        unmarked = [b for b in re.split(r"```bash\n", text)[1:]
                    if not re.search(r"<!-- needs: [^>]+-->\s*$", text[:text.index(b)].rsplit("```bash", 1)[0])]
        if not unmarked:
            continue
        assert page.name in RUN_BY, f"{page.name}: its commands are run by no test; add one or mark the block"
        test_file, evidence = RUN_BY[page.name]
        assert evidence in (ROOT / test_file).read_text(), (page.name, test_file, evidence)


def test_the_version_is_one_number():
    """``fedllm --version``, the package metadata source and the newest CHANGELOG entry agree."""
    from fedllm import __version__

    out = subprocess.run([sys.executable, "-m", "fedllm", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"fedllm {__version__}"
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert cfg["metadata"]["version"] == "attr: fedllm.__version__"
    newest = re.search(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert newest and newest.group(1) == __version__


def tutorial_commands(page: str) -> list[str]:
    return [line for block in blocks((DOCS / "tutorials" / page).read_text(), "bash")
            for line in block.splitlines() if line.startswith("fedllm ")]


@pytest.fixture
def repository_cwd(tmp_path, monkeypatch):
    """A working directory that sees the repository's recipes and test data where the docs' commands expect them."""
    for name in ("recipes", "tests"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_privacy_tutorial_commands_run(repository_cwd):
    """Both commands of the privacy tutorial, as written: central DP reports ε; SecAgg+ completes its rounds."""
    from fedllm.commands.cli import main

    commands = tutorial_commands("privacy.md")
    assert len(commands) == 2
    for command in commands:
        argv = shlex.split(command)[1:] + ["federation.rounds=1", "--quiet"]
        assert main(argv) == 0, command
    import json

    dp = [json.loads(line) for line in (repository_cwd / "runs/tiny-central-dp/metrics.jsonl").read_text().splitlines()]
    assert dp[-1]["epsilon"] > 0
    assert (repository_cwd / "runs/tiny-secagg/final").is_dir()


def test_add_a_strategy_guide_runs_as_written(repository_cwd, monkeypatch, capsys):
    """The guide's two Python blocks as one script (run in this process, on a copy of the strategy registry): the
    strategy registers, validates its argument and runs the tiny recipe; its rule is checked on hand-made states
    (eta = 0.5 goes half-way to the mean)."""
    from fedllm.common.registry import strategies

    guide = (DOCS / "how-to" / "add-a-strategy.md").read_text()
    define, use = blocks(guide, "python")
    check = """
import torch
from fedllm.strategies.base import ClientUpdate
s = FedAvgServerLR(eta=0.5)
g = {"w": torch.zeros(2)}
ups = [ClientUpdate(client_id=0, state={"w": torch.tensor([2.0, 4.0])}, num_examples=1, loss=None, steps=1),
       ClientUpdate(client_id=1, state={"w": torch.tensor([4.0, 8.0])}, num_examples=3, loss=None, steps=1)]
assert torch.equal(s.aggregate(1, g, ups)["w"], torch.tensor([1.75, 3.5]))   # half-way to (3.5, 7.0)
assert FedAvgServerLR.check_args({"eta": 0}) == [("eta", 0, "a number in (0, 10]")]
print("rounds", len(result.history))
"""
    script = define + use.replace("[\"federation.strategy=", "[\"federation.rounds=1\", \"federation.strategy=") + check
    monkeypatch.setattr(strategies, "_items", dict(strategies._items))  # the guide's registration ends with the test
    exec(compile(script, "add-a-strategy.md", "exec"), {"__name__": "__main__"})  # noqa: S102  (the guide as a script)
    assert "rounds 1" in capsys.readouterr().out
