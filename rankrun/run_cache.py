"""One run per distinct example run in a test session, shared by every test that asserts on it.

A run is distinct by what decides what it prints and returns: the snippet, the world size, the
entry point, the extra environment, fresh or warm processes. Many tests look at the same run
(the output file, the numbers against plain PyTorch, the page's claims): the first test that
asks makes it, the others read it. The cache lives in the test session's temporary directory
(RANKRUN_RUN_CACHE, set by the pytest plugin), so the pytest-xdist workers share it; a file lock
per run makes a second worker wait for the run the first one is making, instead of making it
again. Outside a test session (no RANKRUN_RUN_CACHE) nothing is cached.

Every request is logged (`requests.jsonl`), so the session can say how many runs it made, how
many of them were distinct (equal, unless a run had to be made again: see `get_or_run`), and
their rank time.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path

ENVIRONMENT_VARIABLE = "RANKRUN_RUN_CACHE"


def cache_directory() -> Path | None:
    directory = os.environ.get(ENVIRONMENT_VARIABLE)
    return Path(directory) if directory else None


def run_key(snippet: str, world_size: int, entry_point: str | None, env: dict | None, fresh: bool,
            kind: str = "run_snippet", hang: dict | None = None) -> str:
    key = {"kind": kind, "snippet": snippet, "world_size": world_size, "entry_point": entry_point,
           "env": sorted((env or {}).items()), "fresh": fresh}
    if hang is not None:  # a run watched for a hang ends otherwise than one left to its timeout
        key["hang"] = hang
    return json.dumps(key)


def get_or_run(key: str, run: Callable[[], object], timeout: float, cacheable: bool = True,
               timed_out: Callable[[object], bool] = lambda result: False,
               rank_seconds: Callable[[object], float] = lambda result: 0.0,
               outcome: Callable[[object], str] = lambda result: ""):
    """The result of `run()` for `key`: made now, or read from the run another test made.

    A cached run that timed out under a shorter timeout than this request's is made again
    with this one (the test asking now allows the example more time); that is the only case in
    which a distinct run is made twice, and the session's summary shows it.
    """
    directory = cache_directory()
    asked = time.monotonic()
    if directory is None or not cacheable:
        result = run()
        _log(directory, key, made=True, cached=False, seconds=rank_seconds(result), wall=time.monotonic() - asked,
             ended=outcome(result))
        return result
    directory.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(key.encode()).hexdigest()[:24]
    stored = directory / f"{name}.pickle"
    with open(directory / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if stored.exists():
            with open(stored, "rb") as handle:
                made_with, result = pickle.load(handle)
            if not (timed_out(result) and timeout > made_with):
                # wall: how long this request waited for another worker that was making the run
                _log(directory, key, made=False, cached=True, seconds=0.0, wall=time.monotonic() - asked)
                return result
        result = run()
        partial = stored.with_suffix(".partial")
        with open(partial, "wb") as handle:
            pickle.dump((timeout, result), handle)
        partial.replace(stored)
        _log(directory, key, made=True, cached=True, seconds=rank_seconds(result), wall=time.monotonic() - asked,
             ended=outcome(result))
        return result


def _log(directory: Path | None, key: str, made: bool, cached: bool, seconds: float, wall: float = 0.0,
         ended: str = "") -> None:
    """One line per request: besides what the summary counts, the test that asked (pytest's
    PYTEST_CURRENT_TEST), the wall time the request took and how a run made now ended
    ("ok", "failed", "timed out", "hung"), for benchmarks/suite_floor.py."""
    if directory is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    line = json.dumps({"key": key, "made": made, "cached": cached, "rank_seconds": round(seconds, 3),
                       "wall": round(wall, 3), "test": test, "ended": ended})
    with open(directory / "requests.jsonl", "a") as log:  # one short write: atomic with O_APPEND
        log.write(line + "\n")


def summary(directory: Path) -> str | None:
    """One line: the runs this session made, how many distinct, their rank time, and how many
    requests were answered from a run already made."""
    log = directory / "requests.jsonl"
    if not log.exists():
        return None
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    examples = [entry for entry in entries if entry["cached"]]
    made = [entry for entry in examples if entry["made"]]
    others = [entry for entry in entries if not entry["cached"]]
    distinct = len({entry["key"] for entry in made})
    rank_time = sum(entry["rank_seconds"] for entry in entries if entry["made"])
    return (f"rankrun: {len(made)} example runs, {distinct} distinct, {len(examples) - len(made)} requests "
            f"answered from a run already made; {len(others)} harness-case runs; rank time {rank_time:.0f} s")
