"""mkdocs hooks for the static site (`make docs`): the pages stay plain GitHub markdown.

* A fence's info string may carry the marks tests/test_docs.py reads (```python
  excerpt=examples/x.py, ```text diagram); Python-Markdown takes only a bare language, so the
  site sees ```python and ```text.
* A link to a file of the repository outside docs/ (../examples/x.py, ../README.md) works on
  GitHub but is no page of the site: the file must exist (else the build fails), and the site
  shows its path as code.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError

_FENCE_INFO = re.compile(r"^(?P<indent>[ ]{0,3})(?P<fence>```+)(?P<lang>[\w+-]+)[ \t]+[^`\n]*$",
                         re.M)
_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>\.\./[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 - mkdocs API
    """The page as the site renders it."""
    markdown = _FENCE_INFO.sub(r"\g<indent>\g<fence>\g<lang>", markdown)
    docs = Path(config["docs_dir"]).resolve()
    here = (docs / page.file.src_path).parent

    def outside(m: re.Match) -> str:
        target = (here / m.group("target")).resolve()
        if target.is_relative_to(docs):
            return m.group(0)
        if not target.exists():
            raise PluginError(f"{page.file.src_path}: link to {m.group('target')}: no such file")
        path = target.relative_to(docs.parent).as_posix()
        text = m.group("text")
        return text if text.strip("`") == path else f"{text} (`{path}`)"

    return _LINK.sub(outside, markdown)
