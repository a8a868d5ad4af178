"""rankrun: run a documentation snippet on N local ranks, as `torchrun` would, and report.

    from rankrun import run_snippet
    result = run_snippet("snippets/zero3/language_model.py", world_size=2, call="main").check()

See rankrun/runner.py for the API and README.md ("The harness") for what it guarantees.
"""

__all__ = ["RankResult", "RunResult", "SnippetFailed", "run_snippet"]


def __getattr__(name):
    # Imported on first use, so that `rankrun.project` (standard library only) can be read by
    # tasks.py before anything is installed.
    if name in __all__:
        from rankrun import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'rankrun' has no attribute {name!r}")
