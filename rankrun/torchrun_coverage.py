"""Snippet line coverage inside the ranks of a real `torchrun` run, for the examples whose
documented run is the torchrun command itself (rankrun.pages.RUN_BY_TORCHRUN): the command
stays the documented one; a `sitecustomize` on PYTHONPATH starts coverage in each rank that
torchrun started (TORCHELASTIC_RUN_ID is set there, not in the launcher, and an example that
starts interpreters of its own without torchrun's variables measures nothing in them), with
the include pattern of the warm ranks (rankrun/rank_main.py), and writes the lines it ran for the
gate (rankrun.snippet_coverage) at exit, and before `os._exit`, with which the examples end. The
runner adds it only while the example still has a line no traced rank ran.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from rankrun.project import SITECUSTOMIZE_CHAIN, SNIPPETS
from rankrun.snippet_coverage import RANKS

SITECUSTOMIZE = '''
import os
def _measure():
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    from rankrun import snippet_coverage
    if not snippet_coverage.traced_here():
        return
    import coverage
    measured = coverage.Coverage(data_file=None, config_file=False,
                                 include=[os.path.join(os.environ["RANKRUN_SNIPPETS"], "*")])
    measured.start()
    saved = []
    def save():
        if not saved:
            saved.append(True)
            measured.stop()
            snippet_coverage.record_seen(snippet_coverage.lines_of(measured))
    import atexit
    atexit.register(save)
    # The examples end with os._exit (docs/versions.md, "An abort at exit"), which skips atexit.
    leave = os._exit
    def save_and_leave(code):
        save()
        leave(code)
    os._exit = save_and_leave
_measure()
''' + SITECUSTOMIZE_CHAIN


def environment(env: dict[str, str]) -> dict[str, str]:
    """The variables to add to `env` (torchrun's environment) so that its ranks measure coverage."""
    directory = Path(tempfile.mkdtemp(prefix="torchrun-coverage-"))  # in the session's TMPDIR
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(filter(None, [str(directory), env.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "RANKRUN_SNIPPETS": str(SNIPPETS), RANKS: "all"}
