"""MkDocs hook: the site's home page is README.md itself, read at build time (`make docs`).

docs/index.md holds no text of its own, so the home page cannot drift from the README; its links
into docs/ (docs/page.md#anchor, docs/img/x.png) are made relative to the site's pages. Run by
MkDocs (mkdocs.yml `hooks:`), not imported by zerolab."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
DOCS_LINK = re.compile(r"\]\(docs/")


def readme_as_home() -> str:
    """README.md with its docs/ links relative to the docs directory."""
    return DOCS_LINK.sub("](", README.read_text())


def on_page_markdown(markdown, page, config, files):  # MkDocs' hook signature
    return readme_as_home() if page.file.src_uri == "index.md" else markdown
