"""rankrun: run a documentation snippet on N local ranks, as `torchrun` would, and report.

    from rankrun import run_snippet
    result = run_snippet("snippets/zero3/language_model.py", world_size=2, call="main").check()

See rankrun/runner.py for the API and README.md ("The harness") for what it guarantees.
"""

from rankrun.runner import RankResult, RunResult, SnippetFailed, run_snippet

__all__ = ["RankResult", "RunResult", "SnippetFailed", "run_snippet"]
