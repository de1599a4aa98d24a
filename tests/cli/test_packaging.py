"""setup.cfg's promises to an installer: every extra installs on every Python fedllm says it supports."""

import configparser
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

SETUP_CFG = Path(__file__).resolve().parents[2] / "setup.cfg"
PYTHONS = ["3.8", "3.9", "3.10", "3.11", "3.12", "3.13", "3.14"]


def declared():
    cfg = configparser.ConfigParser()
    cfg.read(SETUP_CFG)
    requirements = cfg["options"]["install_requires"].split()
    for extra in cfg["options.extras_require"]:
        requirements += [line.strip() for line in cfg["options.extras_require"][extra].splitlines() if line.strip()]
    return SpecifierSet(cfg["options"]["python_requires"]), [Requirement(r) for r in requirements]


def test_python_requires_holds_for_every_installed_requirement_of_every_extra():
    """flwr >= 1.41 needs Python 3.11: fedllm may not promise 3.10 (issue 38, item 10)."""
    ours, requirements = declared()
    lowest = next(v for v in PYTHONS if v in ours)
    checked = 0
    for req in requirements:
        try:
            theirs = metadata.metadata(req.name)["Requires-Python"]
        except metadata.PackageNotFoundError:
            continue  # not installed here: its own installer checks it
        checked += 1
        assert not theirs or lowest in SpecifierSet(theirs), \
            f"setup.cfg: python_requires {ours} allows {lowest}, but {req.name} requires Python {theirs}"
    assert checked >= 20  # most of them are installed by README's test command ([dev])


def test_flower_is_pinned_to_the_version_the_docs_read():
    """docs/flower.md and docs/privacy.md cite Flower's files by line: the extras pin the version read."""
    _, requirements = declared()
    pins = {str(r.specifier) for r in requirements if r.name == "flwr"}
    assert pins == {"==1.42.0"}
    assert metadata.version("flwr") == "1.42.0"
    docs = Path(SETUP_CFG.parent / "docs" / "flower.md").read_text()
    assert "`flwr==1.42.0`" in docs
