"""A pytest plugin for benchmarks/suite_floor.py: where a test session's CPU goes.

Loaded with `-p cpu_split` (benchmarks/ on PYTHONPATH), in the main process and in every
pytest-xdist worker; each process appends JSON lines to CPU_SPLIT_LOG:

- {"kind": "collection", "cpu": s}: the process's own CPU from its start to the end of collection;
- {"kind": "test", "nodeid", "self": s, "children": s}: each test's setup, call and teardown, the
  CPU of the test process itself and of the processes that ended meanwhile (fresh ranks, torchrun,
  nested pytest or tasks.py sessions, site builds, the browser: what the test started and waited for);
- {"kind": "process", "self": s, "children": s}: the process's totals at its very end, after it
  closed the harness's warm zygotes: the children that were not reaped within a test are the
  zygote and every warm rank it forked (their CPU reaches this process when the zygote is reaped);
  the main process's children also hold its pytest-xdist workers' totals.

It needs nothing from the harness, so it measures any checkout of the project (an older one too).
"""

from __future__ import annotations

import json
import os
import resource

import pytest

LOG = "CPU_SPLIT_LOG"


def _cpu(who) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _write(entry: dict) -> None:
    path = os.environ.get(LOG)
    if path:
        entry["pid"] = os.getpid()
        with open(path, "a") as log:  # one short write: atomic with O_APPEND
            log.write(json.dumps(entry) + "\n")


def pytest_collection_finish(session):
    _write({"kind": "collection", "cpu": round(_cpu(resource.RUSAGE_SELF), 3),
            "worker": hasattr(session.config, "workerinput")})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own, children = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    yield
    _write({"kind": "test", "nodeid": item.nodeid, "self": round(_cpu(resource.RUSAGE_SELF) - own, 3),
            "children": round(_cpu(resource.RUSAGE_CHILDREN) - children, 3)})


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    try:  # the harness's warm zygotes, reaped here so that their CPU (and their ranks') counts here
        from rankrun.pool import close_zygotes

        close_zygotes()
    except Exception:  # noqa: BLE001 - another checkout's harness may differ; then it is counted nowhere
        pass
    _write({"kind": "process", "self": round(_cpu(resource.RUSAGE_SELF), 3),
            "children": round(_cpu(resource.RUSAGE_CHILDREN), 3), "worker": hasattr(config, "workerinput")})
