"""MkDocs hook: pages load nothing from other hosts.

- Mermaid: Material for MkDocs loads Mermaid from unpkg.com unless `window.mermaid` already
  exists. The install step (tasks.py) fetches a pinned copy into
  docs/assets/vendor/mermaid/; this hook loads it, in <head>, on the pages that have a
  diagram, and fails the build when the copy is missing.
- Notebook pages: mkdocs-jupyter's template adds a MathJax loader (cdnjs by default; an
  empty `<script src="">` with its default settings) and a Mermaid loader from cdnjs for
  Mermaid cell outputs. Our notebooks have neither math nor Mermaid outputs, so both are
  removed (a notebook with LaTeX math would need a local MathJax added here); the build
  fails if a notebook has Mermaid output.

tests/site/test_offline.py scans the built site for external assets, and the browser
tests record every request a page makes.
"""

import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.utils import get_relative_url

MERMAID = "assets/vendor/mermaid/mermaid.min.js"

NOTEBOOK_MATHJAX = re.compile(
    r'<!-- Load mathjax -->\s*<script src="[^"]*">\s*</script>\s*<!-- MathJax configuration -->\s*'
    r'<script type="text/x-mathjax-config">.*?</script>\s*<!-- End of mathjax configuration -->',
    re.DOTALL,
)
NOTEBOOK_MERMAID = re.compile(
    r'<script type="module">\s*document\.addEventListener\("DOMContentLoaded", async \(\) => \{\s*'
    r'const diagrams = document\.querySelectorAll\("\.jp-Mermaid > pre\.mermaid"\);.*?</script>',
    re.DOTALL,
)


def on_config(config):
    if not (Path(config.docs_dir) / MERMAID).is_file():
        raise PluginError(
            f"{Path(config.docs_dir) / MERMAID} is missing: the pages load Mermaid from there "
            "instead of a CDN. `python3 tasks.py install` fetches the pinned copy."
        )
    return config


def on_post_page(output, page, config):
    if '<pre class="mermaid">' in output:
        script = f'<script src="{get_relative_url(MERMAID, page.url)}"></script>'
        output = output.replace("</head>", f"{script}\n</head>", 1)
    if "jupyter-wrapper" in output:
        output, removed = NOTEBOOK_MATHJAX.subn("", output)
        if removed != 1:
            raise PluginError(f"{page.file.src_path}: mkdocs-jupyter's MathJax loader was not found; update hooks/offline.py")
        output, removed = NOTEBOOK_MERMAID.subn("", output)
        if removed != 1:
            raise PluginError(f"{page.file.src_path}: mkdocs-jupyter's Mermaid loader was not found; update hooks/offline.py")
        if re.search(r'class="[^"]*\bjp-Mermaid\b', output):
            raise PluginError(f"{page.file.src_path}: has Mermaid output, which would need a local Mermaid module")
    return output
