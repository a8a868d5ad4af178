"""The warm pool: one zygote per session that imported torch and DeepSpeed once and forks each
run's ranks (rankrun/rank_main.py), and a spare pool forked while the previous run works."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from rankrun import project
from rankrun.launch import (RANK_MAIN, ask_for_stacks, collect, hang_watcher, kill_group, torchrun_environment,
                            wait_for_ranks)
from rankrun.project import ROOT
from rankrun.results import RunResult, tail


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
                    f"{self.outputtail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the rank zygote did not fork a worker in time. Its output:\n{self.outputtail()}")
        return self.started.pop(0)

    def outputtail(self) -> str:
        return tail(Path(self.log.name).read_text(errors="replace")) or "(nothing)"

    def exit_code(self, pid: int) -> int | None:
        """The worker's exit code (negative: killed by that signal), or None while it runs."""
        self._read_messages()
        if pid in self.exit_codes:
            return self.exit_codes[pid]
        if not self.alive and not process_exists(pid):  # it died with the zygote (PR_SET_PDEATHSIG)
            return -signal.SIGKILL
        return None

    def close(self) -> None:
        kill_group(self.process)
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
                    raise RuntimeError(f"rank pool worker {rank} did not start:\n{self.logtail()}")
                time.sleep(0.005)
        self.ready = True

    def logtail(self) -> str:
        return tail(Path(self.log.name).read_text(errors="replace"))

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

    def run(self, path: Path, call, timeout: float, grace: float, env, while_it_runs=None, hang=None) -> RunResult:
        """Run the job on every worker, once; the workers end with it. `while_it_runs` is called
        once every rank has its job (the runner forks the next run's ranks then); `hang` (a
        rankrun.hang.HangWatch) declares a hang of ranks waiting for each other."""
        try:
            self.wait_until_ready()
        except BaseException:
            self.close()
            raise
        port = project.free_port()
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
                        "stacks": str(work / f"rank{rank}.stacks") if hang is not None else "",
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

                watcher = hang_watcher(hang, {r: w.pid for r, w in enumerate(self.workers)}, work, started)
                waited = wait_for_ranks(poll, self.world_size, started + timeout, grace, watcher)
            finally:
                still_running = {r for r in range(self.world_size) if codes[r] is None}
                ask_for_stacks({r: self.workers[r].pid for r in still_running}, work)
                self.close()
            for rank in still_running:
                codes[rank] = self.workers[rank].returncode
            for rank in range(self.world_size):  # make sure the files exist even if a worker never opened them
                for stream in ("stdout", "stderr"):
                    (work / f"rank{rank}.{stream}").touch()
            result = collect(path, work, codes, [w.pid for w in self.workers], still_running, started, waited,
                             timeout, port, watcher)
        return result

    def close(self) -> None:
        # Every rank is killed before any is waited for: a rank that outlived its peer's kill by
        # a moment would end its job on the peer's death instead of being killed where it hung.
        for worker in self.workers:
            kill_group(worker, wait=False)
        for worker in self.workers:
            worker.wait()
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
