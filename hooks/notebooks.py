"""MkDocs hook: the notebook pages, executed for real, and reused while nothing they depend on changed.

A notebook under docs/notebooks/ (a jupytext `.py`) is a page. Its outputs come from running it:
the hook executes it in a Jupyter kernel and renders it with mkdocs-jupyter's converter
(the same HTML as the mkdocs-jupyter plugin; `allow_errors` is off, so a failing cell fails
the build). Executing it starts a real 2-rank run, about 20 s or more, so the result is kept in
`.cache/notebooks/` and reused by the next build only while all of these are unchanged:

- the notebook file itself, this hook, and the Python and package versions the output depends
  on (torch, DeepSpeed, and the Jupyter/plotting stack): together the cache key;
- every file of the project the run read: the kernel and every process it starts (the
  torchrun ranks) log each project file they open, through an audit hook installed by a
  `sitecustomize` on their PYTHONPATH. The cache entry stores each such file's SHA-256, so
  editing a snippet the notebook runs (or a file that snippet loads) re-executes it, without
  a hand-kept list of dependencies.

Always executed, never read from the cache: in CI (the `CI` environment variable, set by GitHub
Actions) and when NOTEBOOKS_EXECUTE=always (the workflow and the test suite's strict build set
it). A run still writes the cache, so `mkdocs serve` after the suite starts warm.

The build log says, for each notebook, whether it ran and why, or which run it reused.
The kernel talks to the build over IPC sockets, not TCP: no "Kernel is running over TCP
without encryption" warning in the build's output. Importing the Jupyter stack costs seconds,
so it is imported only when a notebook has to run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import types
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.toc import get_toc

from rankrun.project import SITECUSTOMIZE_CHAIN  # standard library only

log = logging.getLogger("mkdocs.hooks.notebooks")

NOTEBOOKS = "notebooks/*.py"  # under docs/; nothing else under docs/ is a .py
CACHE_DIR = Path(".cache") / "notebooks"  # relative to the directory of mkdocs.yml
FORCE_VARIABLE = "NOTEBOOKS_EXECUTE"
# What the output depends on besides the files: the versions of these, and Python's.
VERSIONED = ["torch", "deepspeed", "matplotlib", "numpy", "mkdocs-jupyter", "nbconvert",
             "nbclient", "ipykernel", "jupytext"]
CELL_TIMEOUT = 1200  # seconds; a cell that runs longer fails the build
# Project paths a run may read without them being inputs (environment, caches, VCS).
NOT_INPUTS = {".venv", ".git", ".cache", "site", "__pycache__"}

# Installed in the kernel and every Python process it starts, through PYTHONPATH. Logs each
# project file opened for reading (a module's .pyc counts as its .py) to NOTEBOOK_READS_LOG.
SITECUSTOMIZE = '''
import os, sys
def _install():
    root, log_path = os.environ["NOTEBOOK_READS_ROOT"], os.environ["NOTEBOOK_READS_LOG"]
    prefix, seen = root.rstrip(os.sep) + os.sep, set()
    def audit(event, args):
        if event != "open" or not isinstance(args[0], str):
            return
        path, mode, flags = args
        path = os.path.abspath(path)  # the ranks open their script by a relative path
        if not path.startswith(prefix):
            return
        if (mode is not None and any(c in mode for c in "wax+")) or (mode is None and flags & 3):
            return
        if path not in seen:
            seen.add(path)
            try:
                with open(log_path, "a") as out:  # mode "a": not logged itself
                    out.write(path + "\\n")
            except FileNotFoundError:  # the build that reads the log was stopped (Ctrl-C)
                pass
    sys.addaudithook(audit)
_install()
''' + SITECUSTOMIZE_CHAIN


class NotebookFile(File):
    """A jupytext notebook, treated as a page: docs/notebooks/x.py -> notebooks/x/index.html."""

    def is_documentation_page(self) -> bool:
        return True


def project_root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def installed(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cache_key(notebook: Path, versions: dict[str, str] | None = None) -> str:
    """The notebook, this hook's code, and the versions its output depends on."""
    versions = versions if versions is not None else {name: installed(name) for name in VERSIONED}
    digest = hashlib.sha256()
    digest.update(notebook.read_bytes())
    digest.update(Path(__file__).read_bytes())
    digest.update(json.dumps({"python": sys.version, **versions}, sort_keys=True).encode())
    return digest.hexdigest()


def cache_file(root: Path, src_uri: str) -> Path:
    return root / CACHE_DIR / (src_uri.replace("/", "--") + ".json")


def forced() -> str | None:
    """Why every notebook must run now, or None when the cache may be used."""
    if os.environ.get("CI"):
        return "CI is set: output is never reused in CI"
    if os.environ.get(FORCE_VARIABLE) == "always":
        return f"{FORCE_VARIABLE}=always"
    return None


def skipped() -> bool:
    """NOTEBOOKS_EXECUTE=never: render the notebooks without outputs (for builds of copies that
    test something else). Never in CI, and never cached."""
    return os.environ.get(FORCE_VARIABLE) == "never" and not forced()


def reusable(root: Path, entry_path: Path, key: str) -> tuple[dict | None, str]:
    """The cache entry if it is valid for `key` and every input is unchanged; else why not."""
    if not entry_path.is_file():
        return None, "no earlier run cached"
    try:
        entry = json.loads(entry_path.read_text())
    except ValueError:
        return None, "the cache entry is unreadable"
    if entry.get("key") != key:
        return None, "the notebook, this hook, or the torch/DeepSpeed/Jupyter versions changed"
    for relative, digest in entry["inputs"].items():
        path = root / relative
        if not path.is_file() or sha256(path) != digest:
            return None, f"{relative}, which the last run read, changed"
    return entry, ""


def reads_of(root: Path, log_path: Path, site_dir: Path) -> dict[str, str]:
    """The project files a run read, from its log: {relative path: SHA-256}."""
    inputs = {}
    lines = log_path.read_text().splitlines() if log_path.is_file() else []
    for line in lines:
        path = Path(line)
        if path.parent.name == "__pycache__" and path.suffix == ".pyc":
            path = path.parent.parent / (path.name.split(".")[0] + ".py")  # x.cpython-311.pyc
        path = Path(os.path.normpath(path))
        if not path.is_file() or not path.is_relative_to(root) or path.is_relative_to(site_dir):
            continue
        relative = path.relative_to(root)
        if NOT_INPUTS & set(relative.parts):
            continue
        inputs[relative.as_posix()] = sha256(path)
    return dict(sorted(inputs.items()))


def execute(notebook: Path, root: Path, site_dir: Path, execute_it: bool = True) -> dict:
    """Run the notebook in a kernel and render it as mkdocs-jupyter does (no "In [1]:" prompts).

    The kernel starts in the notebook's directory, as Jupyter starts it.
    """
    from mkdocs_jupyter import convert, nbconvert2  # seconds to import: only when a notebook runs
    from mkdocs_jupyter.plugin import _get_nb_toc_tokens
    from traitlets.config import Config

    make_app = nbconvert2.get_nbconvert_app

    def app_with_ipc_kernel(**options):
        app = make_app(**options)
        app.config.merge(Config({
            # No TCP ports: no unencrypted-TCP warning. The IPC sockets go to a temporary
            # directory, not to the kernel's working directory (docs/notebooks/).
            "KernelManager": {"transport": "ipc", "ip": str(Path(tmp) / "kernel")},
            # "immediate": the kernel's process group is killed when the run ends. A build stopped
            # by Ctrl-C while a cell runs otherwise asks the kernel to shut down, and the kernel
            # prints a traceback on the terminal (ZMQError: Socket operation on non-socket) as
            # the cell ends. The reads log is written path by path, so a kill loses none.
            "ExecutePreprocessor": {**app.config["ExecutePreprocessor"], "timeout": CELL_TIMEOUT,
                                    "shutdown_kernel": "immediate"},
        }))
        assert app.config.ExecutePreprocessor.enabled == execute_it
        assert not app.config.ExecutePreprocessor.allow_errors
        return app

    with tempfile.TemporaryDirectory(prefix="notebook-reads-") as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        log_path = Path(tmp) / "reads.log"
        saved = {name: os.environ.get(name) for name in
                 ("PYTHONPATH", "NOTEBOOK_READS_ROOT", "NOTEBOOK_READS_LOG")}
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tmp, saved["PYTHONPATH"]]))
        os.environ["NOTEBOOK_READS_ROOT"] = os.path.realpath(root)
        os.environ["NOTEBOOK_READS_LOG"] = str(log_path)
        nbconvert2.get_nbconvert_app = app_with_ipc_kernel
        cwd = os.getcwd()
        started = time.perf_counter()
        try:
            os.chdir(notebook.parent)  # where Jupyter starts a notebook's kernel
            html = convert.nb2html(
                str(notebook), execute=execute_it, kernel_name="", theme="", allow_errors=False,
                show_input=True, no_input=False, no_prompt=True, remove_tag_config={},
                highlight_extra_classes="", include_requirejs=False, custom_mathjax_url="",
            )
        except Exception as error:
            raise PluginError(f"{notebook.relative_to(root)}: a cell failed, so the page cannot be "
                              f"built:\n{type(error).__name__}: {error}") from error
        finally:
            os.chdir(cwd)
            nbconvert2.get_nbconvert_app = make_app
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        seconds = time.perf_counter() - started
        inputs = reads_of(root, log_path, site_dir)
    toc_tokens, title = _get_nb_toc_tokens(str(notebook), 6)
    inputs.pop(notebook.relative_to(root).as_posix(), None)  # in the key already
    return {"html": html, "toc_tokens": toc_tokens, "title": title, "inputs": inputs,
            "executed_at": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(seconds, 1)}



# A code block in a Markdown cell, as nbconvert renders it: Pygments' <div class="highlight"><pre>
# without the <code> element that Material's copy button (and its code styling) attaches to.
MARKDOWN_CELL_BLOCK = re.compile(r'<div class="highlight"><pre><span></span>(.*?)</pre></div>', re.S)


def material_code_blocks(html: str) -> str:
    """Markdown cells' code blocks in the markup of the other pages' code blocks, so that
    Material gives them its copy button (code cells keep mkdocs-jupyter's own button)."""
    html = MARKDOWN_CELL_BLOCK.sub(
        lambda m: f'<div class="highlight"><pre><span></span><code>{m.group(1)}</code></pre></div>', html)
    # nbconvert's cell ids ("cell-id=3d58…") are not valid CSS selectors, and Material builds
    # its copy button's target selector from the id of the block's cell.
    return re.sub(r'id="cell-id=([\w-]+)"', r'id="cell-\1"', html)


def notebook_page(page, config) -> None:
    """Give the page its executed notebook's HTML and table of contents: cached or fresh."""
    root = project_root(config)
    notebook = Path(page.file.abs_src_path)
    entry_path = cache_file(root, page.file.src_uri)
    key = cache_key(notebook)
    if skipped():
        log.info(f"Notebook {page.file.src_uri}: not executed ({FORCE_VARIABLE}=never): "
                 "the page shows no outputs")
        entry = execute(notebook, root, Path(config.site_dir).resolve(), execute_it=False)
        page.content, page.toc = material_code_blocks(entry["html"]), get_toc(entry["toc_tokens"])
        return
    why = forced()
    entry = None
    if why is None:
        entry, why = reusable(root, entry_path, key)
    if entry is not None:
        log.info(f"Notebook {page.file.src_uri}: reusing the run of {entry['executed_at']} "
                 f"(nothing it depends on changed: {len(entry['inputs'])} files it read)")
    else:
        log.info(f"Notebook {page.file.src_uri}: executing ({why})")
        entry = {"key": key, **execute(notebook, root, Path(config.site_dir).resolve())}
        entry_path.parent.mkdir(parents=True, exist_ok=True)
        partial = entry_path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(entry))
        os.replace(partial, entry_path)  # readers never see half an entry
        log.info(f"Notebook {page.file.src_uri}: executed in {entry['seconds']} s; it read "
                 f"{', '.join(entry['inputs']) or 'no project file'}")
    page.content = material_code_blocks(entry["html"])
    page.toc = get_toc(entry["toc_tokens"])
    if entry["title"]:
        page.title = entry["title"]


def on_files(files: Files, config) -> Files:
    return Files([
        NotebookFile(f.src_uri, f.src_dir, f.dest_dir, f.use_directory_urls, inclusion=f.inclusion)
        if f.src_uri.endswith(".py") and Path(f.src_uri).match(NOTEBOOKS) else f
        for f in files
    ])


def on_pre_page(page, config, files):
    if isinstance(page.file, NotebookFile):
        page.render = types.MethodType(lambda self, config, files: notebook_page(self, config), page)
    return page


# Notebook pages, read like the rest of the site: no JupyterLab padding (the text starts where
# every page's text starts), Material's fonts, colours and code-block look for the cells, and
# its syntax colours instead of JupyterLab's; a code cell wider than the page scrolls sideways
# with a visible scrollbar, as Material's code blocks do; the plot (an SVG of its own width)
# shrinks to the page but never grows past its size. `.md-typeset` makes these rules more
# specific than JupyterLab's, which the page has later.
NOTEBOOK_CSS = """<style>
.md-typeset .jupyter-wrapper, .md-typeset .jupyter-wrapper .jp-Notebook {
  padding: 0; background: transparent; color: inherit;
  font-family: inherit; font-size: inherit;
}
.md-typeset .jupyter-wrapper .jp-Cell, .md-typeset .jupyter-wrapper .jp-Cell-inputWrapper,
.md-typeset .jupyter-wrapper .jp-Cell-outputWrapper, .md-typeset .jupyter-wrapper .jp-InputArea,
.md-typeset .jupyter-wrapper .jp-OutputArea, .md-typeset .jupyter-wrapper .jp-OutputArea-child,
.md-typeset .jupyter-wrapper .jp-RenderedHTMLCommon, .md-typeset .jupyter-wrapper .jp-RenderedText,
.md-typeset .jupyter-wrapper .jp-RenderedImage, .md-typeset .jupyter-wrapper .jp-RenderedSVG {
  padding-left: 0; padding-right: 0; margin-left: 0; margin-right: 0;
  background: transparent; color: inherit; font-family: inherit; font-size: inherit;
}
.md-typeset .jupyter-wrapper .jp-Collapser, .md-typeset .jupyter-wrapper .jp-InputPrompt,
.md-typeset .jupyter-wrapper .jp-OutputPrompt { display: none; }
.md-typeset .jupyter-wrapper .jp-CodeCell .jp-InputArea-editor,
.md-typeset .jupyter-wrapper .jp-CodeCell .CodeMirror {
  border: 0; border-radius: .1rem; background: var(--md-code-bg-color);
}
.md-typeset .jupyter-wrapper .highlight-ipynb, .md-typeset .jupyter-wrapper .jp-RenderedText pre {
  background: var(--md-code-bg-color); color: var(--md-code-fg-color);
  font-family: var(--md-code-font-family); font-size: .85em;
}
.md-typeset .jupyter-wrapper .highlight-ipynb {
  overflow-x: auto; scrollbar-width: thin;
  scrollbar-color: var(--md-default-fg-color--lighter) transparent;
}
.md-typeset .jupyter-wrapper .jp-RenderedText pre { padding: .7720588235em 1.1764705882em; }
.md-typeset .jupyter-wrapper .highlight-ipynb span { font-weight: normal; font-style: normal; }
.md-typeset .jupyter-wrapper .highlight-ipynb :is(.k, .kc, .kd, .kn, .kp, .kr, .kt, .ow) {
  color: var(--md-code-hl-keyword-color); }
.md-typeset .jupyter-wrapper .highlight-ipynb :is(.s, .s1, .s2, .sa, .sb, .sc, .sd, .se, .sh, .si, .sx) {
  color: var(--md-code-hl-string-color); }
.md-typeset .jupyter-wrapper .highlight-ipynb :is(.m, .mi, .mf, .mh, .mo, .il) {
  color: var(--md-code-hl-number-color); }
.md-typeset .jupyter-wrapper .highlight-ipynb :is(.nb, .bp, .kc) { color: var(--md-code-hl-constant-color); }
.md-typeset .jupyter-wrapper .highlight-ipynb :is(.nf, .fm, .nc, .nd) { color: var(--md-code-hl-function-color); }
.md-typeset .jupyter-wrapper .highlight-ipynb :is(.c, .c1, .ch, .cm, .cs, .sd) {
  color: var(--md-code-hl-comment-color); }
.md-typeset .jupyter-wrapper .highlight-ipynb :is(.o, .p) { color: var(--md-code-hl-punctuation-color); }
.md-typeset .jupyter-wrapper .highlight-ipynb :is(.n, .nn, .nv, .w) { color: var(--md-code-fg-color); }
.md-typeset .jupyter-wrapper .jp-RenderedImage, .md-typeset .jupyter-wrapper .jp-RenderedSVG { overflow-x: visible; }
.md-typeset .jupyter-wrapper .jp-RenderedImage img, .md-typeset .jupyter-wrapper .jp-RenderedSVG img {
  max-width: 100%; height: auto; }
</style>"""


def on_post_page(output, page, config):
    if isinstance(page.file, NotebookFile):
        output = output.replace("</head>", NOTEBOOK_CSS + "\n</head>", 1)
        # Offer the notebook's source for download.
        target = Path(page.file.abs_dest_path).parent / Path(page.file.src_uri).name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(page.file.abs_src_path, target)
    return output
