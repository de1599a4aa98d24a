"""What README promises a newcomer, checked against the repository: its worked "your own data" example runs as
written, every document it sends a reader to is in the repository, its example commands do not collide, and
what its commands write into the clone is git-ignored."""

from __future__ import annotations

import json
import random
import re
import shlex
import shutil
import subprocess

import pytest

from fedllm.commands.cli import main
from tests.cli.conftest import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")
#: README and the docs pages a newcomer follows after it (its sections moved there), in reading order.
GUIDES = [README] + [(ROOT / "docs" / page).read_text(encoding="utf-8") for page in (
    "tutorials/first-run.md", "tutorials/own-data.md", "tutorials/dpo.md", "tutorials/flower-federation.md",
    "tutorials/privacy.md", "tutorials/reproduce-a-paper.md", "how-to/compression.md", "how-to/track-experiments.md")]
OWN_DATA = (ROOT / "docs" / "tutorials" / "own-data.md").read_text(encoding="utf-8")  # README's "Your own data"


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    return README[start:README.index("\n## ", start + 1)]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_your_own_data_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """The recipe and the two ``fedllm partition`` commands of "Your own data", on a file with its columns: the
    recipe validates (data, split, model and rank checks included), and the recipe-driven and the flag-driven
    partition write the same split."""
    own = OWN_DATA  # docs/tutorials/own-data.md
    recipe_text = blocks(own, "yaml")[0]
    commands = [line.split("#", 1)[0].strip() for line in blocks(own, "bash")[0].splitlines()]
    alternative = next(line.split("# or:", 1)[1].strip() for line in blocks(own, "bash")[0].splitlines()
                       if "# or:" in line)
    rng = random.Random(0)
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b), "topic": rng.choice(["add", "sum", "plus"])}
            for a, b in ((rng.randint(1, 9), rng.randint(1, 9)) for _ in range(60))]
    (tmp_path / "my.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my-recipe.yaml").write_text(recipe_text)
    monkeypatch.chdir(tmp_path)
    from fedllm.recipe.checks import load_recipe

    recipe = load_recipe("my-recipe.yaml", check_files=True, ask_strategy=False)
    assert (recipe.data.path, recipe.federation.num_clients, recipe.federation.partition.column) == \
        ("my.jsonl", 8, "topic")
    partition = next(c for c in commands if c.startswith("fedllm partition"))
    assert main(shlex.split(partition)[1:]) == 0
    assert main(shlex.split(alternative)[1:-1] + ["parts-by-flags/"]) == 0  # its --out, renamed
    capsys.readouterr()
    written = sorted(p.name for p in (tmp_path / "parts").iterdir())
    assert written == [f"client_{c:03d}.jsonl" for c in range(8)] + ["eval.jsonl", "manifest.json"]
    by_recipe, by_flags = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("parts",
                                                                                         "parts-by-flags"))
    assert by_recipe["clients"] == by_flags["clients"] and by_recipe["eval"] == by_flags["eval"]
    assert len(by_recipe["eval"]) == 6  # 10 % of 60 held out
    train = next(c for c in commands if "federation.partition.path=parts/" in c)
    overrides = shlex.split(train)[3:]
    again = load_recipe("my-recipe.yaml", overrides, check_files=True, ask_strategy=False)
    assert again.federation.partition.path == "parts/"
    assert again.output_dir != recipe.output_dir  # run after the recipe's own run, it does not collide with it


def test_every_file_readme_links_to_is_in_the_repository():
    """README's relative links (docs/DESIGN.md, the docs, recipes, figures) all resolve in the clone."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    assert "docs/DESIGN.md" in targets
    assert [t for t in targets if "://" not in t and not (ROOT / t).exists()] == []


def github_anchors(markdown: str) -> set[str]:
    """The ``#anchors`` GitHub gives a document's headings: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to ``-``, a repeated heading numbered ``-1``, ``-2`` ... (code blocks hold no headings)."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", re.sub(r"```.*?```", "", markdown, flags=re.DOTALL), re.MULTILINE):
        text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        seen.setdefault(f"{slug}-{seen[slug]}" if seen[slug] else slug, 0)
    return set(seen)


def test_every_section_readme_links_to_exists():
    """README's ``#section`` links, to its own headings and to those of the documents it links (a renamed heading
    breaks them silently on GitHub; the docs site's own links are checked by ``mkdocs build --strict``)."""
    assert {"set-up", "one-gpu", "preference-alignment-dpo-and-its-family"} <= github_anchors(README)
    assert "2-mixed-precision" in github_anchors("# 1. Intro\n## 2. Mixed `precision`\n```\n# not a heading\n```")
    links = re.findall(r"\]\(([^)\s:]*)#([^)\s]+)\)", README)
    assert len(links) >= 2
    broken = [f"{path}#{anchor}" for path, anchor in links
              if anchor not in github_anchors((ROOT / path).read_text(encoding="utf-8") if path else README)]
    assert broken == []


def test_example_commands_of_one_block_write_to_different_run_directories():
    """Run one after another, the commands of a block must not refuse each other (the N-process examples, the
    Flower run after the one-process run); a --resume line continues its run's directory on purpose."""
    for block in (b for guide in GUIDES for b in blocks(guide, "bash")):
        dirs = [d for line in block.splitlines() if "--resume" not in line
                for d in re.findall(r"\boutput_dir=(\S+)", line)]
        assert len(dirs) == len(set(dirs)), block



def test_readmes_training_commands_followed_in_order_write_to_different_run_directories():
    """A newcomer runs the quickstart, then the commands further down: a run that would land in a directory an
    earlier command filled is refused ("already holds a run"). Across every bash block, each training command
    (the recipe's ``output_dir`` or its override; dry runs, resumes and placeholders aside) has its own."""
    import yaml

    dirs = []
    lines = [line for guide in GUIDES for b in blocks(guide, "bash") for line in b.splitlines()]
    for line in dict.fromkeys(lines):  # a command shown twice (README and its tutorial) is one command
        command = re.search(r"fedllm (?:train|flower run) (.*)", line.split("  #")[0])
        if command is None:
            continue
        argv = shlex.split(command.group(1).split("&&")[0])
        if {"--dry-run", "--resume"} & set(argv) or not argv[0].startswith("recipes/"):
            continue
        given = [a.split("=", 1)[1] for a in argv if a.startswith("output_dir=")]
        dirs.append(given[0] if given else yaml.safe_load((ROOT / argv[0]).read_text())["output_dir"])
    assert "runs/quickstart" in dirs and len(dirs) >= 6
    assert sorted(d for d in set(dirs) if dirs.count(d) > 1) == []

@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_what_readmes_commands_write_into_the_clone_is_git_ignored():
    """The quickstart's data (``--out data/arith``), Flower's keys (``certs/``, holding ``ca.key``), the SuperLink's
    state (``--database superlink.db``, its SQLite journal files and fedllm's nonces beside it), runs (the default
    ``output_dir``) and ``fedllm eval``'s results for a hub model."""
    from fedllm.recipe.schema import Recipe

    said = "\n".join(GUIDES)
    assert "--out data/arith" in README and "fedllm flower certs certs/" in said
    assert "--database superlink.db " in said
    written = ["data/arith/train.jsonl", "certs/ca.key", "superlink.db", "superlink.db-wal", "superlink.db-shm",
               "superlink.db.fedllm-nonces", f"{Recipe().output_dir}/metrics.jsonl",
               "eval_results/tiny-llama/results.json"]
    out = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=ROOT, capture_output=True, text=True,
                         check=False)
    assert sorted(out.stdout.split()) == sorted(written), out.stderr


def test_ci_runs_readmes_test_command():
    """`.ci/run` runs README's "Run the tests" command: its install line, then its pytest command, word for word."""
    command = next(line for block in blocks(section("Set up"), "bash") for line in block.splitlines()
                   if "pytest" in line)
    install, pytest_command = command.rsplit(" && ", 1)
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install in ci_lines
    assert f"{pytest_command} || status=$?" in ci_lines


def test_readmes_set_up_makes_a_virtual_environment_before_installing_as_ci_does():
    """A newcomer following README installs into a virtual environment of its own (issue 52: README never said so),
    made and activated with .ci/run's own lines, before the first ``pip install``."""
    text = section("Set up")
    venv = "python3 -m venv .venv && . .venv/bin/activate"
    assert venv in text and text.index(venv) < text.index("pip install")
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci_lines.index("python3 -m venv .venv") < ci_lines.index(". .venv/bin/activate") < next(
        i for i, line in enumerate(ci_lines) if line.startswith("pip install"))
