"""The two commands (tasks.py) under misuse: an interrupted or concurrent install, a broken
environment (a missing version, deleted files, the project not installed from this checkout),
Ctrl-C (at a real pseudo-terminal, and a SIGINT to tasks.py alone) while pytest or the
notebook runs, bad addresses, options and commands, pytest options that turn xdist off, and
the coverage gate from tests/.

The install cases run tasks.py for real in a scratch copy of the project whose
constraints pin only pip itself, so an install there takes seconds, not minutes.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from importlib.metadata import version
from types import SimpleNamespace

import pytest

from rankrun import coverage_gate
from rankrun.runner import ROOT

pytestmark = pytest.mark.slow  # checks of the commands, not of an example

SMALL_PIN = version("iniconfig")  # pinned in constraints.txt, so pip finds it where the real install did


def load_tasks():
    spec = importlib.util.spec_from_file_location("tasks", ROOT / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    return tasks


@pytest.fixture
def scratch_project(tmp_path):
    return make_scratch_project(tmp_path)


@pytest.fixture(scope="module")
def installed_scratch_project(tmp_path_factory):
    """One installed scratch project for the tests that start from a finished install."""
    project = make_scratch_project(tmp_path_factory.mktemp("installed"))
    done = run_tasks(project, "install")
    assert done.returncode == 0, done.stderr
    return project


def make_scratch_project(tmp_path: Path) -> Path:
    """tasks.py with a tiny project beside it: installing it only needs what is on disk."""
    shutil.copy(ROOT / "tasks.py", tmp_path / "tasks.py")
    (tmp_path / "constraints.txt").write_text(f"iniconfig=={SMALL_PIN}\nsetuptools=={version('setuptools')}\n")
    (tmp_path / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "scratch"\nversion = "0"\n[project.optional-dependencies]\ntest = []\n'
        '[project.entry-points.pytest11]\nscratch = "scratchpkg.plugin"\n'
        '[tool.setuptools]\npackages = ["scratchpkg"]\n'
    )
    (tmp_path / "scratchpkg").mkdir()
    (tmp_path / "scratchpkg" / "__init__.py").write_text("")
    (tmp_path / "scratchpkg" / "plugin.py").write_text("")
    vendor = ROOT / "docs" / "assets" / "vendor"
    shutil.copytree(vendor, tmp_path / "docs" / "assets" / "vendor", symlinks=False)
    # The scratch project installs one small pinned distribution instead of torch and deepspeed,
    # then itself (editable, with its entry point); every other line of tasks.py is the real one.
    text = (tmp_path / "tasks.py").read_text()
    for step, instead in (('pip_install("torch", "setuptools")', 'pip_install("iniconfig", "setuptools")'),
                          ('pip_install("--no-build-isolation", "deepspeed")', 'pass'),
                          ('pip_install("--no-build-isolation", "-e", ".[test,lint,notebook,transformers]")',
                           'pip_install("--no-build-isolation", "-e", ".[test]")')):
        assert step in text, step
        text = text.replace(step, instead)
    (tmp_path / "tasks.py").write_text(text)
    return tmp_path


def run_tasks(project: Path, *args: str, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tasks.py", *args], cwd=project, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_an_install_interrupted_while_creating_the_environment_is_redone(scratch_project, tmp_path):
    # Ctrl-C while venv.create is still running (ensurepip): it ends, and leaves no file of its own.
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    install = subprocess.Popen([sys.executable, "tasks.py", "install"], cwd=scratch_project,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(temporary)})
    deadline = time.monotonic() + 120
    while not any(temporary.rglob("tmp*")) and time.monotonic() < deadline:  # ensurepip's, with its wheels
        time.sleep(0.05)
    assert (scratch_project / ".venv" / "bin" / "python").exists()
    install.send_signal(signal.SIGINT)
    _, err = install.communicate(timeout=60)
    assert install.returncode == 130, err
    assert err.endswith("tasks.py: interrupted\n"), err
    venv = scratch_project / ".venv"
    assert venv.exists() and not (venv / ".created").exists()  # a half-made environment was left
    assert list(temporary.iterdir()) == []  # ensurepip's copy of the wheels went with it

    again = run_tasks(scratch_project, "install")
    assert again.returncode == 0, again.stderr
    assert "was left half-made by an interrupted install; creating it again" in again.stdout
    assert subprocess.run([venv / "bin" / "python", "-m", "pip", "--version"], capture_output=True).returncode == 0
    assert (venv / ".created").exists() and (venv / ".installed-from").exists()


def test_a_second_install_waits_for_the_first_then_finds_it_done(installed_scratch_project):
    scratch_project = installed_scratch_project
    with open(scratch_project / ".venv.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # an install in progress
        second = subprocess.Popen([sys.executable, "tasks.py", "install"], cwd=scratch_project,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(2)
        assert second.poll() is None  # waiting, not installing alongside
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert "another install of .venv is running; waiting for it" in err
    assert "+ -m pip install" not in out  # the first one finished it


def test_a_broken_environment_is_repaired_before_the_command_runs(installed_scratch_project):
    scratch_project = installed_scratch_project
    python = scratch_project / ".venv" / "bin" / "python"
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", "iniconfig"], check=True, capture_output=True)

    repaired = run_tasks(scratch_project, "install")
    assert repaired.returncode == 0, repaired.stderr
    assert (f"the environment does not match constraints.txt; repairing it:\n  iniconfig=={SMALL_PIN}: not installed"
            in repaired.stdout)
    assert subprocess.run([python, "-c", "import iniconfig"]).returncode == 0
    assert "repairing" not in run_tasks(scratch_project, "install").stdout  # healthy now: nothing to do


def test_the_health_check_names_missing_and_mismatched_distributions(tmp_path):
    tasks = load_tasks()
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("pytest==0.0.1\nno-such-distribution==1.0\n# a comment\ntorch==2.13.0\n")
    tasks.CONSTRAINTS = constraints
    problems = tasks.environment_problems()
    assert problems == [
        f"pytest==0.0.1: found {pytest.__version__}",
        "no-such-distribution==1.0: not installed",
    ]  # torch 2.13.0+cpu matches torch==2.13.0


def test_serve_on_a_taken_port_says_so_at_once_and_how_to_choose_another():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run([sys.executable, "tasks.py", "serve", "--dev-addr", f"127.0.0.1:{port}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert time.monotonic() - started < 30  # no build first
    assert f"cannot serve on http://127.0.0.1:{port}/: Address already in use" in done.stderr
    assert "--dev-addr 127.0.0.1:8001" in done.stderr
    assert "Serving the site" not in done.stdout
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("args, workers", [
    (["--quick"], ["-n", str(os.cpu_count() or 1), "--dist", "loadfile"]),
    (["--quick", "-p", "no:xdist"], []),
    (["-pno:xdist"], []),
    (["-n", "0"], []),
])
def test_pytest_arguments_pass_workers_only_when_xdist_is_on(args, workers):
    arguments = load_tasks().pytest_arguments(args)
    assert ("-n" in arguments and arguments[:4] == workers) or (not workers and "--dist" not in arguments)


def gate_config(invocation_dir: Path, args: list[str], source=pytest.Config.ArgsSource.ARGS, **options):
    values = {"snippet_coverage": None, "collectonly": False, "keyword": "", "markexpr": "", "changed": False,
              **options}
    return SimpleNamespace(
        getoption=values.__getitem__, args=args, args_source=source,
        invocation_params=SimpleNamespace(dir=invocation_dir),
    )


@pytest.mark.parametrize("where, args, options, on", [
    (ROOT, [], {}, True),  # `pytest` from the root: testpaths
    (ROOT / "tests", [str(ROOT / "tests")], {"markexpr": "not slow"}, True),  # `cd tests && pytest -m "not slow"`
    (ROOT, ["tests"], {}, True),
    (ROOT, ["tests/zero3"], {}, False),
    (ROOT, [], {"keyword": "language_model"}, False),
    (ROOT, [], {"markexpr": "slow"}, False),
    (ROOT, [], {"collectonly": True}, False),
])
def test_the_coverage_gate_is_on_for_the_whole_suite_from_any_directory(where, args, options, on):
    source = pytest.Config.ArgsSource.TESTPATHS if where == ROOT and not args else pytest.Config.ArgsSource.ARGS
    config = gate_config(where, args, source, **options)
    assert coverage_gate.gate_is_on(config) is on
    assert coverage_gate.why_gate(config)[1]  # the report header says why


def test_the_deepspeed_op_is_compiled_before_the_tests_only_when_missing(tmp_path, monkeypatch):
    """`tasks.py test` compiles DeepSpeed's CPU op itself when this environment lacks it (so no
    test's timeout pays the compile), removes a lock a killed build left, and does nothing when
    the op is there."""
    tasks = load_tasks()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(tasks, "run_in_venv", lambda *args: calls.append(args) or 0)
    op = tmp_path / "deepspeed_shm_comm"
    op.mkdir()
    stale = op / "lock"
    stale.write_text("")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    tasks.build_deepspeed_op()
    assert calls == [("-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()")]
    assert not stale.exists()
    (op / "deepspeed_shm_comm.so").write_bytes(b"")
    tasks.build_deepspeed_op()
    assert len(calls) == 1  # already compiled: nothing to do


# --- The environment check sees a broken install, not only versions.

def scratch_python(project: Path) -> Path:
    return project / ".venv" / "bin" / "python"


def test_an_uninstalled_project_is_noticed_and_installed_again(installed_scratch_project):
    """Without the project's own install pytest runs without the harness's plugin (its options
    unknown: `'Namespace' object has no attribute '--order'`); the check names it and repairs."""
    project, python = installed_scratch_project, scratch_python(installed_scratch_project)
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", "scratch"], check=True, capture_output=True)

    repaired = run_tasks(project, "install")
    assert repaired.returncode == 0, repaired.stderr
    assert ("the environment does not match constraints.txt; repairing it:\n"
            "  scratch (this project, pip install -e .): not installed\n") in repaired.stdout
    entry_points = "from importlib.metadata import entry_points; print(entry_points(group='pytest11')['scratch'].value)"
    assert subprocess.run([python, "-I", "-c", entry_points], capture_output=True, text=True).stdout == "scratchpkg.plugin\n"
    assert "repairing" not in run_tasks(project, "install").stdout


def test_a_package_whose_files_are_gone_is_noticed_and_reinstalled(installed_scratch_project):
    """pip keeps a distribution whose files were deleted for installed (its metadata is there):
    the check finds its module missing, and the repair reinstalls it at its pinned version."""
    project, python = installed_scratch_project, scratch_python(installed_scratch_project)
    where = subprocess.run([python, "-c", "import iniconfig; print(iniconfig.__file__)"], capture_output=True,
                           text=True, check=True).stdout.strip()
    shutil.rmtree(Path(where).parent)  # the package's files; iniconfig-*.dist-info stays
    assert subprocess.run([python, "-m", "pip", "show", "-q", "iniconfig"], capture_output=True).returncode == 0

    repaired = run_tasks(project, "install")
    assert repaired.returncode == 0, repaired.stderr
    assert (f"repairing it:\n  iniconfig=={SMALL_PIN}: installed, but its files are gone (no module 'iniconfig')\n"
            in repaired.stdout)
    assert f"--force-reinstall --no-deps iniconfig=={SMALL_PIN}" in repaired.stdout
    assert subprocess.run([python, "-c", "import iniconfig"]).returncode == 0
    assert "repairing" not in run_tasks(project, "install").stdout


def test_the_project_installed_from_another_checkout_is_noticed_and_installed_from_this_one(
        installed_scratch_project, tmp_path):
    project, python = installed_scratch_project, scratch_python(installed_scratch_project)
    other = tmp_path / "other-checkout"
    shutil.copytree(project, other, ignore=shutil.ignore_patterns(".venv", "*.egg-info", "build"))
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", other],
                   check=True, capture_output=True)

    repaired = run_tasks(project, "install")
    assert repaired.returncode == 0, repaired.stderr
    assert (f"  scratch (this project): scratchpkg.plugin is imported from {os.path.realpath(other)}/scratchpkg/"
            f"__init__.py, not from {os.path.realpath(project)}\n") in repaired.stdout
    where = subprocess.run([python, "-I", "-c", "import scratchpkg; print(scratchpkg.__file__)"], capture_output=True,
                           text=True).stdout
    assert where == f"{os.path.realpath(project)}/scratchpkg/__init__.py\n"


def test_the_health_check_of_the_real_environment_finds_nothing_within_half_a_second():
    """Every command runs the check first. Measured as CPU time (the interpreter's start
    included): on a loaded machine the wall-clock time measures the load."""
    import resource

    def cpu_of_children():
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    tasks = load_tasks()
    times = []
    for _ in range(3):
        before = cpu_of_children()
        assert tasks.environment_problems() == []
        times.append(cpu_of_children() - before)
    assert sorted(times)[1] < 0.5, times


# --- Interrupting the commands: the child ends in its own way, and nothing is left behind.

WAITING_TESTS = '''
import os, time
from pathlib import Path

def test_passes():
    pass

def test_waits():
    Path(os.environ["WAITING_FILE"]).write_text("")
    time.sleep(120)
'''


def start_waiting_session(tmp_path: Path, workers: str, terminal: bool):
    """`tasks.py test -n <workers>` on a test that waits, in this checkout; returns it once the
    test waits. With `terminal`, it runs on a pseudo-terminal of its own, as in a shell."""
    (tmp_path / "case").mkdir()
    (tmp_path / "case" / "test_waiting.py").write_text(WAITING_TESTS)
    (tmp_path / "tmp").mkdir()
    waiting = tmp_path / "waiting"
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "WAITING_FILE": str(waiting)}
    command = [sys.executable, "tasks.py", "test", "-n", workers, "-p", "no:cacheprovider", str(tmp_path / "case")]
    if terminal:
        import pty
        import termios

        main_fd, terminal_fd = pty.openpty()
        session = subprocess.Popen(command, cwd=ROOT, env=env, stdin=terminal_fd, stdout=terminal_fd,
                                   stderr=terminal_fd, start_new_session=True,
                                   preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(terminal_fd)
        session.terminal = main_fd
    else:
        session = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
    deadline = time.monotonic() + 120
    while not waiting.exists():
        assert session.poll() is None and time.monotonic() < deadline, "the test never started"
        time.sleep(0.05)
    # The other test's result must have reached pytest's terminal before the interrupt, or the
    # summary cannot count it: under load, a worker's report can arrive seconds after the test.
    session.early_output = output_until_a_result(session.terminal if terminal else session.stdout.fileno(),
                                                 session, deadline)
    return session


# pytest's first progress mark after collection: a test's result was reported.
FIRST_RESULT = re.compile(r"2 items.*?(?:^|\s)[.FEsx]+(?:\s|$)", re.S | re.M)
TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def output_until_a_result(fd: int, session, deadline: float) -> str:
    seen = b""
    while not FIRST_RESULT.search(TERMINAL_CODES.sub("", seen.decode(errors="replace"))):
        assert session.poll() is None and time.monotonic() < deadline, (
            "no test result reported: " + seen.decode(errors="replace"))
        if select.select([fd], [], [], 0.1)[0]:
            seen += os.read(fd, 65536)
    return seen.decode(errors="replace")


def read_terminal(fd: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: every process of the terminal has closed it
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("workers", ["0", "2"])
def test_sigint_to_tasks_py_lets_pytest_finish_its_session(tmp_path, workers):
    """A SIGINT sent to tasks.py alone (kill -INT, a supervisor) reaches pytest, which ends its
    session as it does on Ctrl-C: its summary, its temporary directory removed; tasks.py waits."""
    import psutil

    session = start_waiting_session(tmp_path, workers, terminal=False)
    below = psutil.Process(session.pid).children(recursive=True)
    session.send_signal(signal.SIGINT)
    try:
        # Generous: a loaded machine (the rest of the suite beside it) slows pytest's teardown.
        output, _ = session.communicate(timeout=180)
    finally:
        session.kill()
    output = session.early_output + output
    assert session.returncode == 2, output  # pytest's exit status for an interrupted session
    assert "KeyboardInterrupt" in output and "1 passed" in output, output
    assert "Traceback" not in output, output
    psutil.wait_procs(below, timeout=10)
    assert not [p for p in below if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert list((tmp_path / "tmp").iterdir()) == []  # the session's directory went with it


def test_ctrl_c_at_the_terminal_lets_pytest_finish_its_session(tmp_path):
    """Ctrl-C in a terminal reaches tasks.py, pytest and its workers at once: pytest ends its
    session once (tasks.py passes nothing on) and tasks.py waits for it."""
    session = start_waiting_session(tmp_path, "2", terminal=True)
    os.write(session.terminal, b"\x03")  # the terminal sends SIGINT to the foreground job
    try:
        session.wait(timeout=180)  # generous under load, as above
    finally:
        session.kill()
    output = session.early_output + read_terminal(session.terminal)
    assert session.returncode == 2, output
    assert "KeyboardInterrupt" in output and "1 passed" in output, output
    assert "Traceback" not in output, output
    assert list((tmp_path / "tmp").iterdir()) == []


# --- Command-line mistakes: one line, exit 2, before any work.

@pytest.mark.parametrize("args, message", [
    (["serve", "--dev-addr", "127.0.0.1:99999"], "--dev-addr 127.0.0.1:99999: the port must be from 1 to 65535, not 99999"),
    (["serve", "--dev-addr=garbage"], "--dev-addr 'garbage' is not host:port (for example 127.0.0.1:8001)"),
    (["serve", "-a", "127.0.0.1:"], "--dev-addr '127.0.0.1:' is not host:port (for example 127.0.0.1:8001)"),
    (["serve", "--dev-addr", "192.0.2.1:8001"], "cannot serve on http://192.0.2.1:8001/: Cannot assign requested address"),
    (["frobnicate"], "unknown command 'frobnicate'; the commands are serve, test, notebook, matrix "
                     "(python3 tasks.py --help says what each does)"),
])
def test_a_mistake_on_the_command_line_is_one_line_and_exit_2(args, message):
    done = subprocess.run([sys.executable, "tasks.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", f"tasks.py: {message}\n")


def test_help_is_the_usage_and_exit_0_and_no_command_is_exit_2():
    tasks = load_tasks()
    done = subprocess.run([sys.executable, "tasks.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, tasks.__doc__ + "\n", "")
    bare = subprocess.run([sys.executable, "tasks.py"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (bare.returncode, bare.stdout, bare.stderr) == (2, "", tasks.__doc__ + "\n")


def test_serve_with_an_unknown_option_says_so_before_serving():
    with socket.socket() as probe:  # a free port: the machine may serve something on any fixed one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run([sys.executable, "tasks.py", "serve", "--dev-addr", f"127.0.0.1:{port}", "--no-such-option"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.endswith("tasks.py: serve: No such option '--no-such-option' "
                                "(python3 tasks.py serve --help lists the options)\n"), done.stderr
    assert "Serving" not in done.stdout and "Traceback" not in done.stderr


def free_local_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("args", [
    ["serve", "--dev-addr", "127.0.0.1:{port}"],  # NOTEBOOKS_EXECUTE=always: the first build runs the notebook
    ["test", "-n", "0", "-p", "no:cacheprovider", "tests/test_site.py::test_site_builds_strict"],
], ids=["serve", "test"])
def test_ctrl_c_while_the_notebook_runs_leaves_no_process_and_no_file(args):
    """Ctrl-C while the site's notebook executes (a Jupyter kernel in a session of its own, which
    the terminal's signal does not reach, running a 2-rank torchrun): the command ends without
    a traceback, and nothing it started is left running or on disk."""
    import pty
    import termios

    import psutil

    # A short temporary directory, as /tmp is: the kernel's IPC sockets go below it, and a
    # socket's path has at most 107 bytes.
    temporary = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    env = {**os.environ, "TMPDIR": str(temporary), "NOTEBOOKS_EXECUTE": "always"}
    main_fd, terminal_fd = pty.openpty()
    command = [sys.executable, "tasks.py", *(arg.format(port=free_local_port()) for arg in args)]
    session = subprocess.Popen(command, cwd=ROOT, env=env, stdin=terminal_fd, stdout=terminal_fd,
                               stderr=terminal_fd, start_new_session=True,
                               preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(terminal_fd)
    output = []
    reader = __import__("threading").Thread(target=lambda: output.append(read_terminal(main_fd)), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        started = []
        while not any("torch.distributed.run" in p.cmdline() for p in started):  # the cell's run
            assert session.poll() is None and time.monotonic() < deadline, "the notebook never started"
            time.sleep(0.2)
            try:
                started = psutil.Process(session.pid).children(recursive=True)
            except psutil.Error:
                started = []
        time.sleep(2)  # its cell runs
        started = psutil.Process(session.pid).children(recursive=True)
        os.write(main_fd, b"\x03")
        session.wait(timeout=120)
    finally:
        session.kill()
    reader.join(timeout=30)
    text = "".join(output)
    assert session.returncode in (1, 2), text  # mkdocs' "Aborted!" during a build; pytest's interrupted session
    assert "Traceback" not in text and "ZMQError" not in text, text
    psutil.wait_procs(started, timeout=15)
    assert [p.pid for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == [], text
    left = list(temporary.iterdir())
    shutil.rmtree(temporary)
    assert left == [], text
