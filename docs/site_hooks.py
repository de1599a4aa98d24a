"""MkDocs hook of fedllm's docs site: a page's link to a repository file outside ``docs/`` (a recipe, a bench, a
data_prep script) becomes that path in code type, and the build fails when the file does not exist, so such links
are checked like the site's own (``mkdocs build --strict`` already fails on a broken link between pages)."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(?<!!)\[([^\]]+)\]\((?!https?://|mailto:|#)([^)\s#]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 — MkDocs' hook signature
    """Rewrite links that leave docs/ into code-typed repository paths; refuse those whose file is missing."""
    docs_dir = Path(config["docs_dir"]).resolve()
    page_dir = (docs_dir / page.file.src_uri).parent

    def rewrite(match: re.Match) -> str:
        text, target = match.group(1), match.group(2)
        path = Path(posixpath.normpath(str(page_dir / target)))
        if path.is_relative_to(docs_dir):
            return match.group(0)  # a page or an asset of the site: MkDocs checks it
        if not path.exists():
            raise PluginError(f"{page.file.src_uri}: link to {target}: no such file in the repository")
        shown = path.relative_to(ROOT).as_posix()
        return text if text.strip("`") == shown else f"{text} (`{shown}`)"

    return LINK.sub(rewrite, markdown)
