"""Run one snippet file on N local ranks, the way `torchrun` would, and report.

    result = run_snippet("snippets/zero3/language_model.py", world_size=2)
    result.check()              # raises SnippetFailed naming the snippet and rank
    result.output               # what the ranks printed, rank by rank
    result.ranks[1].exception   # {"type", "name", "message", "traceback"} or None

Every rank sees the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus DS_ACCELERATOR=cpu, so the
snippet's own `deepspeed.init_distributed(dist_backend="gloo")` works unchanged.

By default each rank is a process forked for this run from a warm zygote that
imported torch and DeepSpeed once (rankrun/rank_main.py): it starts warm, runs
this one snippet and ends, so no state passes from one snippet to the next.
`fresh=True` starts new interpreters instead, exactly like torchrun.

Each rank is a child subreaper: what a snippet starts and leaves running (also in
a new session, also orphaned) is killed, and the run fails with
"left a process running: PID CMD". A rank the runner has to kill (hung, or still
running after a peer failed) is first asked for its Python stack, which the
failure report shows.

Fail fast: once a rank has failed, the others get `grace` seconds to finish or
fail on their own, then they are killed (they are usually blocked in a
collective and gloo would wait 30 minutes). A whole run is bounded by
`timeout`. A failed or timed-out run kills every process it used, and their
children, before `run_snippet` returns; the next run starts a new pool.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

def find_project_root(start: Path) -> Path:
    """The docs project the snippets belong to: the nearest directory at or above `start` that
    holds mkdocs.yml (or `start` itself if none does)."""
    for directory in (start, *start.parents):
        if (directory / "mkdocs.yml").is_file():
            return directory
    return start


# Set RANKRUN_PROJECT to choose the project; by default it is found from the working directory,
# so pytest run from any directory of the project finds the same one.
ROOT = Path(os.environ.get("RANKRUN_PROJECT") or find_project_root(Path.cwd().resolve())).resolve()
SNIPPETS = ROOT / "snippets"
RANK_MAIN = Path(__file__).resolve().parent / "rank_main.py"

# Lines DeepSpeed itself writes to stdout (its logger and its op loader). They
# are not the example's output, so pages and output files leave them out.
DEEPSPEED_NOISE = re.compile(
    r"^(\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[(DEBUG|INFO|WARNING|ERROR|CRITICAL)\] "
    r"|DeepSpeed \S+ built successfully$)"
)

# The first line of each thread in a faulthandler dump, and the frames of the runner below a snippet.
STACK_DUMP = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$")
HARNESS_FRAME = re.compile(r'^  File "(<frozen runpy>|' + re.escape(str(Path(__file__).resolve().parent)) + r'/rank_main\.py)"')

# An object's memory address in a message ("<function f at 0x7f63...>"): it changes from run
# to run and from rank to rank, so a rank's cause (and an output file) shows it as "0x…".
MEMORY_ADDRESS = re.compile(r"(?<= at )0x[0-9a-f]+(?=>)")

# How gloo fails on a rank whose peer died first: a consequence, not a cause.
PEER_WENT_AWAY = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe")


def printed_by_the_example(stdout: str) -> str:
    """The lines of `stdout` that the example printed itself, without DeepSpeed's log lines."""
    return "".join(line + "\n" for line in stdout.splitlines() if not DEEPSPEED_NOISE.match(line))


class SnippetFailed(AssertionError):
    """A snippet run did not succeed; the message names the snippet, the rank and the cause."""


@dataclass
class RankResult:
    rank: int
    pid: int
    exit_code: int | None  # negative: killed by that signal
    stdout: str
    stderr: str
    exception: dict | None = None  # {"type", "name", "message", "traceback"}
    returned: Any = None  # what the called function returned (call=... runs only)
    killed_by_runner: bool = False
    left_running: list[str] = field(default_factory=list)  # "PID CMD" of processes the snippet left behind

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.exception is None and not self.left_running

    def _stack_start(self) -> int | None:
        lines = self.stderr.splitlines()
        starts = [i for i, line in enumerate(lines) if STACK_DUMP.match(line)]
        return starts[0] if self.killed_by_runner and starts else None

    @property
    def stack(self) -> str | None:
        """Where a rank the runner killed was: every thread's Python stack, dumped on request
        just before the kill (faulthandler's format, most recent call first), without the
        runner's own frames below the snippet; or None."""
        start = self._stack_start()
        if start is None:
            return None
        return "\n".join(line for line in self.stderr.splitlines()[start:] if not HARNESS_FRAME.match(line))

    @property
    def stderr_before_stack(self) -> str:
        start = self._stack_start()
        return self.stderr if start is None else "\n".join(self.stderr.splitlines()[:start])

    def cause(self) -> str:
        if self.exception:
            return f"{self.exception['name']}: {MEMORY_ADDRESS.sub('0x…', self.exception['message'])}"
        if self.killed_by_runner:
            return "killed by the runner (still running after the run ended)"
        if self.left_running:
            return "left a process running: " + "; ".join(self.left_running)
        if self.exit_code is not None and self.exit_code < 0:
            return f"killed by signal {signal.Signals(-self.exit_code).name}"
        return f"exited with code {self.exit_code}"


@dataclass
class RunResult:
    snippet: Path
    world_size: int
    ranks: list[RankResult]
    seconds: float
    timed_out: bool = False
    timeout: float = 0.0
    failed_first: list[int] = field(default_factory=list)  # ranks that failed before the runner stepped in
    port: int = 0  # MASTER_PORT of the run
    first_failure_seconds: float | None = None  # when the runner first saw a rank fail, from the start
    retried_because: str | None = None  # the failure report of a first attempt whose port was taken

    @property
    def port_was_taken(self) -> bool:
        return any(rank.exception and "EADDRINUSE" in rank.exception["message"] for rank in self.ranks)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rank.ok for rank in self.ranks)

    @property
    def name(self) -> str:
        try:
            return str(self.snippet.relative_to(ROOT))
        except ValueError:
            return str(self.snippet)

    @property
    def output(self) -> str:
        """What the example printed: every rank's stdout in rank order, DeepSpeed's log lines left out."""
        return "".join(printed_by_the_example(rank.stdout) for rank in self.ranks)

    @property
    def errors(self) -> list[str]:
        """Why the ranks that failed first failed, sorted and without repeats.

        `Type: message` for an exception, `rank N exited with code C` or
        `rank N killed by signal S` otherwise. Ranks that fail *because* a peer
        went away (gloo's "Connection closed by peer", with a port number that
        changes from run to run) are left out when there is another cause.
        """
        def causes(ranks):
            return {rank.cause() if rank.exception else f"rank {rank.rank} {rank.cause()}" for rank in ranks}

        first = causes(rank for rank in self.ranks if rank.rank in self.failed_first)
        # A rank that died without a word can be seen a poll later than the peer
        # that noticed it: then look at every rank that failed on its own.
        for candidates in (first, causes(rank for rank in self.ranks if not rank.ok and not rank.killed_by_runner)):
            root_causes = {cause for cause in candidates if not PEER_WENT_AWAY.search(cause)}
            if root_causes:
                return sorted(root_causes)
        return sorted(first)

    def transcript(self) -> str:
        """What an output file holds: the printed output, then the exceptions raised, if any."""
        return self.output + "".join(line + "\n" for line in self.errors)

    def failure_report(self) -> str:
        if self.ok:
            return f"{self.name} succeeded on {self.world_size} ranks"
        failed = [rank for rank in self.ranks if not rank.ok]
        first = [rank for rank in failed if rank.rank in self.failed_first] or failed
        head = f"{self.name} failed on {self.world_size} ranks after {self.seconds:.1f}s"
        if self.timed_out:
            head += f": timed out after {self.timeout:.0f}s"
        parts = [head]
        pages = self.pages()
        if pages:
            parts.append(f"shown on {', '.join(pages)}")
        for rank in failed:
            parts.append(f"rank {rank.rank}: {rank.cause()}")
        for rank in first:
            detail = rank.exception["traceback"] if rank.exception else _tail(rank.stderr_before_stack)
            if detail.strip():
                parts.append(f"--- rank {rank.rank} ---\n{detail.rstrip()}")
        for rank in failed:
            if rank.stack:
                parts.append(f"--- rank {rank.rank}: where it was when the runner killed it ---\n{rank.stack}")
        return "\n".join(parts)

    def pages(self) -> list[str]:
        """The pages (docs/...) that include this snippet with --8<--, whole or a section of it."""
        from rankrun.pages import pages_including  # (rankrun.pages imports this module)

        return pages_including(self.name)

    def check(self) -> RunResult:
        if not self.ok:
            raise SnippetFailed(self.failure_report())
        return self

    def returned(self, rank: int = 0) -> Any:
        return self.ranks[rank].returned


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the rank's whole process group (the rank and anything it started)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


# How long the runner waits for hung ranks to write their stacks before it kills them.
STACK_DUMP_WAIT = 2.0


def ask_for_stacks(pids: dict[int, int], work: Path, wait: float = STACK_DUMP_WAIT) -> None:
    """Ask the still-running ranks (rank -> pid) for their stacks (SIGUSR1: faulthandler, see
    rank_main.dump_stacks_on_request) and wait until each has written one to its stderr file
    in `work`, or `wait` seconds."""

    def stderr_of(rank: int) -> str:
        path = work / f"rank{rank}.stderr"
        return path.read_text(errors="replace") if path.exists() else ""

    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait
    pending = {rank: (-1, 0.0) for rank in pids}  # rank -> (length of its stderr, when it last grew)
    while pending and time.monotonic() < deadline:
        now = time.monotonic()
        for rank, (length, grew_at) in list(pending.items()):
            text = stderr_of(rank)
            if len(text) != length:
                pending[rank] = (len(text), now)
            elif now - grew_at > 0.1 and any(STACK_DUMP.match(line) for line in text.splitlines()):
                del pending[rank]  # it dumped, and has written nothing more for 0.1 s
        time.sleep(0.02)


def resolve_snippet(snippet: str | os.PathLike) -> Path:
    path = Path(snippet)
    if not path.is_absolute():
        path = ROOT / path
    if not path.is_file():
        raise FileNotFoundError(f"no snippet file at {path}")
    return path


def torchrun_environment(rank: int, world_size: int) -> dict[str, str]:
    """The variables torchrun sets for one local rank (MASTER_PORT is per run), plus the CPU accelerator."""
    environment = {
        "DS_ACCELERATOR": "cpu",
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "PYTHONUNBUFFERED": "1",
    }
    if world_size > 1:
        # Like torchrun: one OpenMP thread per rank unless the caller chose otherwise
        # (torchrun: "to avoid your system being overloaded"; more ranks than cores here).
        environment["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    return environment


def _wait_for_ranks(poll, world_size: int, deadline: float, grace: float):
    """Poll every rank until all are done, one failed `grace` seconds ago, or the deadline passed.

    poll(rank) gives the rank's exit code, or None while it runs.
    Returns (exit codes, ranks that failed first, when they were seen failing or None, timed out?).
    """
    failed_first: list[int] = []
    first_failure_at = None
    while True:
        codes = [poll(rank) for rank in range(world_size)]
        now = time.monotonic()
        if first_failure_at is None:
            failed_first = [r for r, code in enumerate(codes) if code not in (None, 0)]
            if failed_first:
                first_failure_at = now
        if all(code is not None for code in codes):
            return codes, failed_first, first_failure_at, False
        if first_failure_at is not None and now - first_failure_at > grace:
            return codes, failed_first, first_failure_at, False
        if now > deadline:
            return codes, failed_first, first_failure_at, True
        time.sleep(0.01)


def _collect(path, work: Path, world_size, codes, pids, still_running, started, timed_out, timeout, failed_first,
             failed_at, port):
    ranks = []
    for rank in range(world_size):
        report = {}
        report_file = work / f"rank{rank}.report"
        if report_file.exists() and rank not in still_running:
            with open(report_file, "rb") as handle:
                report = pickle.load(handle)
        ranks.append(
            RankResult(
                rank=rank,
                pid=pids[rank],
                exit_code=codes[rank],
                stdout=(work / f"rank{rank}.stdout").read_text(errors="replace"),
                stderr=(work / f"rank{rank}.stderr").read_text(errors="replace"),
                exception=report.get("exception"),
                returned=report.get("returned"),
                killed_by_runner=rank in still_running,
                left_running=report.get("left_running") or [],
            )
        )
    return RunResult(
        snippet=path, world_size=world_size, ranks=ranks, seconds=time.monotonic() - started,
        timed_out=timed_out, timeout=timeout, failed_first=failed_first, port=port,
        first_failure_seconds=None if failed_at is None else failed_at - started,
    )


def run_fresh(path: Path, world_size: int, call, timeout: float, grace: float, env) -> RunResult:
    """One new process per rank, like torchrun: slow to start, nothing shared with earlier runs."""
    port = free_port()
    started = time.monotonic()
    processes: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="snippet-run-") as workdir:
        work = Path(workdir)
        try:
            for rank in range(world_size):
                rank_env = {**os.environ, **torchrun_environment(rank, world_size), "MASTER_PORT": str(port), **(env or {})}
                command = [sys.executable, str(RANK_MAIN), str(path), str(work / f"rank{rank}.report")]
                if call:
                    command.append(call)
                with open(work / f"rank{rank}.stdout", "wb") as out, open(work / f"rank{rank}.stderr", "wb") as err:
                    processes.append(subprocess.Popen(
                        command, cwd=ROOT, env=rank_env, stdin=subprocess.DEVNULL,
                        stdout=out, stderr=err, start_new_session=True,
                    ))
            codes, failed_first, failed_at, timed_out = _wait_for_ranks(
                lambda rank: processes[rank].poll(), world_size, started + timeout, grace)
        finally:
            still_running = {r for r, process in enumerate(processes) if process.poll() is None}
            ask_for_stacks({r: processes[r].pid for r in still_running}, work)
            for process in processes:
                _kill_group(process)
        codes = [process.returncode for process in processes]
        return _collect(path, work, world_size, codes, [p.pid for p in processes], still_running,
                        started, timed_out, timeout, failed_first, failed_at, port)


# How long the other ranks still wait once rank 0's store listens. Measured here with
# rankrun/tests/cases/hello.py: with no pause, about 1 run in 30 spent 5 s in
# init_process_group (rank 0's store waiting for its workers); with 50 ms, none in 300.
LISTEN_SETTLE = 0.05


def listening(port: int) -> bool:
    """True if some socket of this machine listens on TCP `port` (from /proc/net/tcp and tcp6).

    Read by hand, not with psutil.net_connections: that maps every socket to its process and
    took 13 ms a call here, and this is polled every 2 ms while rank 0 starts."""
    suffix = f":{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows)
                for row in rows:
                    fields = row.split()
                    if fields[1].endswith(suffix) and fields[3] == "0A":  # 0A: LISTEN
                        return True
        except FileNotFoundError:
            continue
    return False


def process_exists(pid: int) -> bool:
    """True while `pid` is a process that is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Zygote:
    """One process that imported torch and DeepSpeed once and forks warm pool workers on request.

    See `zygote` in rank_main.py. A pool (re)start costs a fork per rank instead of a new
    interpreter importing torch, DeepSpeed and what they load lazily (~5 s of CPU each).
    The zygote dies with the test process, and its workers die with it.
    """

    def __init__(self, environment: dict[str, str]):
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.NamedTemporaryFile(prefix="rank-zygote-", suffix=".log", delete=False)
        try:
            self.process = subprocess.Popen(
                [sys.executable, str(RANK_MAIN), "--zygote", str(theirs.fileno())],
                cwd=ROOT, env=environment, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=self.log, pass_fds=[theirs.fileno()], start_new_session=True,
            )
        finally:
            theirs.close()
        self.started: list[int] = []
        self.exit_codes: dict[int, int] = {}

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def _read_messages(self, wait: float = 0.0) -> None:
        """Take in what the zygote reported (waiting up to `wait` seconds for the first message)."""
        while select.select([self.control], [], [], wait)[0]:
            try:
                message = self.control.recv(65536)
            except ConnectionError:  # it died with our request unread
                message = b""
            if not message:  # the zygote is gone
                return
            news = json.loads(message)
            if "started" in news:
                self.started.append(news["started"])
            else:
                self.exit_codes[news["exited"]] = news["code"]
            wait = 0.0

    def fork(self, environment: dict[str, str], jobs_fd: int, reply_fd: int, log_fd: int, deadline: float) -> int:
        """A new worker with `environment` on top of the zygote's; returns its pid."""
        try:
            socket.send_fds(self.control, [json.dumps({"env": environment}).encode()], [jobs_fd, reply_fd, log_fd])
        except ConnectionError:
            pass  # it is gone: said below, with its own output
        while not self.started:
            self._read_messages(wait=0.05)
            if self.started:
                break
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the rank zygote (the process that imports torch and DeepSpeed once for the warm pool) "
                    f"exited with code {self.process.returncode} before it forked a worker. Its output:\n"
                    f"{self.output_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the rank zygote did not fork a worker in time. Its output:\n{self.output_tail()}")
        return self.started.pop(0)

    def output_tail(self) -> str:
        return _tail(Path(self.log.name).read_text(errors="replace")) or "(nothing)"

    def exit_code(self, pid: int) -> int | None:
        """The worker's exit code (negative: killed by that signal), or None while it runs."""
        self._read_messages()
        if pid in self.exit_codes:
            return self.exit_codes[pid]
        if not self.alive and not process_exists(pid):  # it died with the zygote (PR_SET_PDEATHSIG)
            return -signal.SIGKILL
        return None

    def close(self) -> None:
        _kill_group(self.process)
        self.control.close()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


class ForkedWorker:
    """A pool worker the zygote forked: what RankPool uses of subprocess.Popen (pid, stdin, poll, wait)."""

    def __init__(self, zygote: Zygote, pid: int, stdin):
        self.zygote, self.pid, self.stdin = zygote, pid, stdin
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            self.zygote._read_messages(wait=0.01)
        return self.returncode


_zygotes: dict[str | None, Zygote] = {}


def zygote_for(omp_num_threads: str | None) -> Zygote:
    """The session's zygote for this OpenMP thread count (read once, when torch is imported)."""
    zygote = _zygotes.get(omp_num_threads)
    if zygote is None or not zygote.alive:
        if zygote is not None:
            zygote.close()
        environment = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
        environment.pop("OMP_NUM_THREADS", None)
        if omp_num_threads is not None:
            environment["OMP_NUM_THREADS"] = omp_num_threads
        zygote = _zygotes[omp_num_threads] = Zygote(environment)
    return zygote


def zygote_pids() -> list[int]:
    """The pids of this session's zygotes (they end with the session)."""
    return [zygote.process.pid for zygote in _zygotes.values() if zygote.alive]


def close_zygotes() -> None:
    close_pools()  # their workers report to a zygote
    while _zygotes:
        _zygotes.popitem()[1].close()


class RankPool:
    """`world_size` rank processes forked from the warm zygote, for one run.

    The workers start warm (torch and DeepSpeed imported), each runs one job and ends: the
    next run gets new ones, so nothing a snippet did to its process can reach another
    snippet. Each run gets a new MASTER_PORT, so the snippet's own init_distributed /
    init_process_group builds a new process group. The runner keeps one spare pool per world
    size, forked while the previous run works, so a run rarely waits for a fork.
    """

    def __init__(self, world_size: int, startup_timeout: float = 180.0):
        self.world_size = world_size
        self.workers: list[ForkedWorker] = []
        self.replies: list[int] = []
        self.buffers: list[bytes] = []
        self.ready = False
        self.log = tempfile.NamedTemporaryFile(prefix=f"rank-pool-{world_size}-", suffix=".log", delete=False)
        self.deadline = time.monotonic() + startup_timeout
        try:
            for rank in range(world_size):
                environment = torchrun_environment(rank, world_size)
                zygote = zygote_for(environment.get("OMP_NUM_THREADS"))
                jobs_read, jobs_write = os.pipe()
                reply_read, reply_write = os.pipe()
                try:
                    pid = zygote.fork(environment, jobs_read, reply_write, self.log.fileno(), self.deadline)
                except BaseException:
                    os.close(jobs_write)
                    os.close(reply_read)
                    raise
                finally:
                    os.close(jobs_read)
                    os.close(reply_write)
                os.set_blocking(reply_read, False)
                self.replies.append(reply_read)
                self.buffers.append(b"")
                self.workers.append(ForkedWorker(zygote, pid, os.fdopen(jobs_write, "wb")))
        except BaseException:
            self.close()
            raise

    def wait_until_ready(self) -> None:
        """Wait for every worker's "ready" line (they were forked in __init__)."""
        for rank in range(self.world_size):
            while not self.ready and self._reply(rank) is None:
                if self.workers[rank].poll() is not None or time.monotonic() > self.deadline:
                    raise RuntimeError(f"rank pool worker {rank} did not start:\n{self.log_tail()}")
                time.sleep(0.005)
        self.ready = True

    def log_tail(self) -> str:
        return _tail(Path(self.log.name).read_text(errors="replace"))

    def _has_replied(self, rank: int) -> bool:
        """Take in what the worker wrote; True once a whole reply line is there (not consumed)."""
        try:
            self.buffers[rank] += os.read(self.replies[rank], 65536)
        except BlockingIOError:
            pass
        return b"\n" in self.buffers[rank]

    def _reply(self, rank: int) -> dict | None:
        """The worker's next reply line, if it has written one."""
        if not self._has_replied(rank):
            return None
        line, self.buffers[rank] = self.buffers[rank].split(b"\n", 1)
        return json.loads(line)

    @property
    def alive(self) -> bool:
        return bool(self.workers) and all(worker.poll() is None for worker in self.workers)

    def _wait_for_rank0_to_listen(self, port: int, deadline: float) -> None:
        """Hold back the other ranks until rank 0 listens on MASTER_PORT (it hosts the TCPStore).

        A rank that connects before the store listens is refused and sleeps 250-750 ms
        (torch's ExponentialBackoffWithJitter) before it retries: in a warm pool, where
        ranks start within milliseconds, that happened in about a third of the runs and
        was most of their time. Gives up at `deadline`, or when rank 0 has answered or
        died (it failed before it listened).
        """
        while time.monotonic() < deadline:
            if listening(port):
                time.sleep(LISTEN_SETTLE)
                return
            if self._has_replied(0) or self.workers[0].poll() is not None:
                return
            time.sleep(0.002)

    def run(self, path: Path, call, timeout: float, grace: float, env, while_it_runs=None) -> RunResult:
        """Run the job on every worker, once; the workers end with it. `while_it_runs` is called
        once every rank has its job (the runner forks the next run's ranks then)."""
        try:
            self.wait_until_ready()
        except BaseException:
            self.close()
            raise
        port = free_port()
        started = time.monotonic()
        codes: list[int | None] = [None] * self.world_size
        with tempfile.TemporaryDirectory(prefix="snippet-run-") as workdir:
            work = Path(workdir)
            still_running: set[int] = set()
            try:
                for rank, worker in enumerate(self.workers):
                    job = {
                        "snippet": str(path), "function": call or "",
                        "report": str(work / f"rank{rank}.report"),
                        "stdout": str(work / f"rank{rank}.stdout"), "stderr": str(work / f"rank{rank}.stderr"),
                        "env": {"MASTER_PORT": str(port), **(env or {})},
                    }
                    worker.stdin.write((json.dumps(job) + "\n").encode())
                    worker.stdin.flush()
                    if rank == 0 and self.world_size > 1:
                        self._wait_for_rank0_to_listen(port, min(started + timeout, time.monotonic() + 2.0))
                if while_it_runs is not None:
                    while_it_runs()

                def poll(rank):
                    if codes[rank] is None:
                        reply = self._reply(rank)
                        if reply is not None:
                            codes[rank] = reply["exit_code"]
                        elif self.workers[rank].poll() is not None:  # the worker itself died
                            codes[rank] = self.workers[rank].returncode
                    return codes[rank]

                _, failed_first, failed_at, timed_out = _wait_for_ranks(poll, self.world_size, started + timeout, grace)
            finally:
                still_running = {r for r in range(self.world_size) if codes[r] is None}
                ask_for_stacks({r: self.workers[r].pid for r in still_running}, work)
                self.close()
            for rank in still_running:
                codes[rank] = self.workers[rank].returncode
            for rank in range(self.world_size):  # make sure the files exist even if a worker never opened them
                for stream in ("stdout", "stderr"):
                    (work / f"rank{rank}.{stream}").touch()
            result = _collect(path, work, self.world_size, codes, [w.pid for w in self.workers], still_running,
                              started, timed_out, timeout, failed_first, failed_at, port)
        return result

    def close(self) -> None:
        for worker in self.workers:
            _kill_group(worker)
            if worker.stdin:
                worker.stdin.close()
        for fd in self.replies:
            os.close(fd)
        self.replies = []
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


_spares: dict[int, RankPool] = {}


def close_pools() -> None:
    """Close the spare pools (their workers never ran anything)."""
    while _spares:
        _spares.popitem()[1].close()


atexit.register(close_zygotes)  # the pools first, then the zygotes that forked them


def pool_for_a_run(world_size: int) -> RankPool:
    """The spare pool of this world size if it is still whole, else a new one."""
    pool = _spares.pop(world_size, None)
    if pool is not None and not pool.alive:
        pool.close()
        pool = None
    return pool or RankPool(world_size)


def fork_a_spare(world_size: int) -> None:
    """Fork the next run's pool now: it gets ready while the caller goes on."""
    if world_size not in _spares:
        _spares[world_size] = RankPool(world_size)


# Snippet line coverage (rankrun/coverage_gate.py) is measured in the first run of each
# entry point of an example (the file as __main__, or one of its functions): the gate
# asks that every line ran in some rank, and the coverage tracer adds ~40% to a
# DeepSpeed run, so repeats (other world sizes, other tests) run without it.
_measured_entry_points: set[tuple[Path, str | None]] = set()


def _coverage_wanted(path: Path) -> bool:
    return bool(os.environ.get("SNIPPET_COVERAGE_DATA")) and path.is_relative_to(SNIPPETS)


def run_snippet(
    snippet: str | os.PathLike,
    world_size: int = 2,
    *,
    call: str | None = None,
    timeout: float = 120.0,
    grace: float = 3.0,
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> RunResult:
    """Run `snippet` on `world_size` local ranks; see the module docstring.

    call: the name of a function in the snippet to call instead of running it as
    `__main__`; its return value (picklable) comes back in `RankResult.returned`.
    fresh: start new processes for this run instead of using the warm pool.
    env: extra environment variables for the ranks.
    """
    path = resolve_snippet(snippet)
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    entry_point = (path, call)
    if _coverage_wanted(path) and entry_point not in _measured_entry_points:
        env = {**(env or {}), "SNIPPET_COVERAGE_THIS_RUN": "1"}
    first_attempt = None
    for _ in range(2):
        if fresh:
            result = run_fresh(path, world_size, call, timeout, grace, env)
        else:
            # The next run's ranks are forked while this one runs: a fork costs ~0.06 s per rank.
            result = pool_for_a_run(world_size).run(path, call, timeout, grace, env,
                                                    while_it_runs=lambda: fork_a_spare(world_size))
            fork_a_spare(world_size)  # if the run ended before its ranks all had the job
        if first_attempt is not None:
            result.retried_because = first_attempt.failure_report()
        if not result.port_was_taken:
            _measured_entry_points.add(entry_point)
        if result.ok or not result.port_was_taken or first_attempt is not None:
            return result
        # The port was free when the runner chose it, and something took it before
        # rank 0 could listen (another test run, say). The choice was the runner's,
        # so it tries once more with another port.
        first_attempt = result
    return result
