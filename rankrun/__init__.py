"""rankrun: run a documentation snippet on N local ranks, as `torchrun` would, and report.

    from rankrun import run_snippet
    result = run_snippet("snippets/zero3/language_model.py", world_size=2, call="main").check()

See rankrun/runner.py for the API; what it guarantees, each tested in rankrun/tests/, is on
docs/testing.md ("The runner's contract", "What happens when a rank fails").

The modules, by what they are:

    project.py           where the project is (root, snippets, docs), the rank-count line of a
                         torchrun command, `free_port`, the pins; standard library only
    runner.py            `run_snippet` and `run_torchrun` on top of the layers below, and the
                         names tests use
    results.py           `RunResult`, `RankResult`, `SnippetFailed`: what a run gives back, and
                         the failure report
    launch.py            fresh ranks (`fresh=True`, like torchrun), fail-fast waiting, stack
                         dumps of hung ranks, collecting a run
    hang.py              a hang of ranks waiting for each other, declared from evidence
    pool.py              the zygote that imports torch and DeepSpeed once, and the warm pools
                         it forks
    run_cache.py         one run per distinct run in a test session, shared across workers;
                         the summary line
    entry.py             the function a snippet's main block calls (a `call="main"` run is the
                         `__main__` run)
    rank_main.py         the rank process, and the zygote's main loop
    lifetime.py          how a rank's and the zygote's processes live and end: subreaper,
                         death with the parent, what a snippet left running
    processes.py         the process table the runner's tests read (nothing left running),
                         and how they start a command they interrupt
    plugin.py            pytest plugin: `expect_output` fixture, `--update-outputs`, `--changed`,
                         `--order`, one temporary directory per session
    selection.py         pytest plugin: `--shard`, `--store-durations`, `--smallest-rank-count`
    changed.py           which tests a change can affect (`--changed`)
    marks.py             the `kernel_independent` reasons (the second pass leaves those out)
    shards.py            the suite in N shards by recorded durations (the hosted CI's matrix)
    coverage_gate.py     pytest plugin: the session fails unless every line under `snippets/`
                         ran in some rank
    snippet_coverage.py  which runs the gate traces (only those that can still add a line), the
                         lines they saw; the verdict on the union of the shards' lines
    torchrun_coverage.py the same coverage inside the ranks of a real `torchrun`
    site_build.py        the session's one strict build of the site, shared by the site tests
    pages.py             where the examples are: snippet files, output files, the pages'
                         `--8<--` includes, documented rank counts
    tolerance.py         the one tolerance policy for comparing a run with plain PyTorch
    reference.py         one-process references to compare a run with (losses and full
                         gradients), and the loader of a snippet's names (example_namespace)
"""

__all__ = ["RankResult", "RunResult", "SnippetFailed", "run_snippet"]


def __getattr__(name):
    # Imported on first use, so that `rankrun.project` (standard library only) can be read by
    # tasks.py before anything is installed.
    if name in __all__:
        from rankrun import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'rankrun' has no attribute {name!r}")
