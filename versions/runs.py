"""Running a release in its environment: the probe (import DeepSpeed, start a one-rank gloo
group), then every documented command planned on it with the environment's real `torchrun`,
each rank's output kept apart; the release's row of the data is built from those runs."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from rankrun.project import free_port
from versions.environments import ensure_env, ensure_overlay, env_dir, env_is_current, extensions_dir, locked, log
from versions.outputs import ABORT_AT_EXIT, compared, last_exception, printed
from versions.plan import ROOT, commands_for, documented_commands, package_commands_for, parse_command

RUN_TIMEOUT = 900.0  # seconds for one torchrun command
PROBE_TIMEOUT = 2400.0  # the first import compiles an op: ~5 min on 2 loaded cores, 10+ when very loaded


def run_environment(env: Path, extra: dict[str, str]) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items()
                   if key not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "LOCAL_SIZE"}}
    environment.update({
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": str(extensions_dir(env)),
        "PATH": f"{env / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        **extra,
    })
    return environment


def run_command(python: Path, env: Path, ranks: int, path: str, extra: dict[str, str]) -> dict:
    """One documented command with real torchrun: what each rank printed, raised and exited with."""
    with tempfile.TemporaryDirectory(prefix="matrix-run-") as logs:
        command = [str(python), "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                   "--master_port", str(free_port()), "--log-dir", logs, "--redirects", "3",
                   "--tee", "0", path]
        started = time.monotonic()
        process = subprocess.Popen(command, cwd=ROOT, env=run_environment(env, extra),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        try:
            agent_out, agent_err = process.communicate(timeout=RUN_TIMEOUT)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            agent_out, agent_err = process.communicate()
            timed_out = True
        seconds = time.monotonic() - started
        outcome = {"ranks": [], "exit": process.returncode, "timed_out": timed_out}
        for rank in range(ranks):
            found = glob.glob(os.path.join(logs, "*", "attempt_0", str(rank)))
            stdout = stderr = ""
            if found:
                stdout = Path(found[0], "stdout.log").read_text(errors="replace")
                stderr = Path(found[0], "stderr.log").read_text(errors="replace")
            outcome["ranks"].append({
                "printed": printed(stdout),
                "raised": last_exception(stderr),
                "aborted_at_exit": ABORT_AT_EXIT in stderr,
            })
    outcome["seconds"] = round(seconds, 1)
    return outcome


def probe(python: Path, env: Path, extra: dict[str, str]) -> dict:
    """Import DeepSpeed and start a one-rank gloo group (this compiles DeepSpeed's CPU
    communication op into the environment's TORCH_EXTENSIONS_DIR once)."""
    code = ("import deepspeed, torch\n"
            "deepspeed.init_distributed(dist_backend='gloo')\n"
            "torch.distributed.barrier()\n"
            "print(deepspeed.__version__, torch.__version__)\n")
    environment = run_environment(env, {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                                        "MASTER_PORT": str(free_port()), **extra})
    # A compile that was interrupted (a killed run) leaves torch's lock file behind, and the next
    # load would wait for it forever. Only this process builds in this environment (.build.lock).
    for stale in extensions_dir(env).glob("*/lock"):
        stale.unlink()
    started = time.monotonic()
    process = subprocess.Popen([str(python), "-c", code], cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the compiler too, not only the interpreter
        process.communicate()
        raise
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    result = {"ok": done.returncode == 0, "seconds": round(time.monotonic() - started, 1)}
    if done.returncode == 0:
        result["versions"] = done.stdout.split()[-2:]
    else:
        result["raised"] = last_exception(done.stderr) or (done.stderr.strip().splitlines() or ["?"])[-1]
    return result


def run_release(version: str, config: dict, repeat: int, only: list[str] | None = None) -> dict:
    spec = config["releases"][version]
    extra = {key: str(value) for key, value in spec.get("env", {}).items()}
    # Building (pip, and the op DeepSpeed compiles on its first run, which the probe triggers)
    # is the heavy part: two matrix processes never build at the same time. A warm environment
    # (up to date, its op compiled) needs no lock.
    warm = env_is_current(version, config) and any(extensions_dir(env_dir(version)).glob("*/*.so"))
    with (contextlib.nullcontext() if warm else locked(".build.lock")):
        started = time.monotonic()
        env, built = ensure_env(version, config)
        build_seconds = round(time.monotonic() - started, 1)
        python = env / "bin" / "python"
        log(f"{version}: environment {'built' if built else 'reused'} ({build_seconds} s); "
            f"importing deepspeed and starting a one-rank group")
        # The probe's result is kept with the environment: a warm run (same environment,
        # same variables) reuses it; the examples import DeepSpeed again anyway.
        cached = env / ".matrix-probe.json"
        key = (env / ".matrix-stamp").read_text() + json.dumps(extra, sort_keys=True)
        kept = json.loads(cached.read_text()) if cached.is_file() else {}
        if kept.get("key") == key:
            row = {"env": extra, "probe": {**kept["probe"], "seconds": 0.0}}
        else:
            row = {"env": extra, "probe": probe(python, env, extra)}
            cached.write_text(json.dumps({"key": key, "probe": {k: v for k, v in row["probe"].items()
                                                                 if k != "seconds"}}))
    log(f"{version}: import {'ok' if row['probe']['ok'] else 'failed'} ({row['probe']['seconds']} s)")
    timings = {"built": built, "build_seconds": build_seconds, "probe_seconds": row["probe"].pop("seconds")}
    if not row["probe"]["ok"]:
        log(f"{version}: cannot run: {row['probe']['raised']}")
        return {"row": row, "timings": timings}
    row["probe"].pop("versions", None)
    row["examples"] = {}

    def record(section: str, key: str, ranks: int, path: str, variables: dict) -> None:
        entry, seconds = repeated(python, env, ranks, path, variables, repeat)
        row.setdefault(section, {})[key] = entry
        timings.setdefault("runs", {})[key] = seconds
        log(f"{version}: {key}: {describe_run(row[section][key])} ({', '.join(map(str, seconds))} s)")

    for key in commands_for(version, config):
        if only and not any(part in key for part in only):
            continue
        _, _, ranks, path = key.split(" ", 3)
        record("examples", key, int(ranks), path, extra)
    for key in package_commands_for(version, config):
        if only and not any(part in key for part in only):
            continue
        packages, ranks, path = parse_command(key)
        overlay = ensure_overlay(version, packages, env)
        with_overlay = {**extra, "PYTHONPATH": str(overlay / "site-packages")}
        record("with_packages", key, ranks, path, with_overlay)
    if extra and config.get("env_check"):
        path = config["env_check"]["example"]
        for ranks, _ in documented_commands(path)[:1]:
            outcome = compared(run_command(python, env, ranks, path, {}))
            row["without_env"] = {"command": f"torchrun --nproc_per_node {ranks} {path}",
                                  "raised": outcome["raised"], "ok": outcome["ok"]}
    return {"row": row, "timings": timings}


def repeated(python: Path, env: Path, ranks: int, path: str, extra: dict, repeat: int) -> tuple[dict, list]:
    """One documented command run `repeat` times: its entry in the data (the first run's outcome,
    whether every run gave it, how many aborted at exit) and each run's seconds."""
    runs = [run_command(python, env, ranks, path, extra) for _ in range(repeat)]
    first = compared(runs[0])
    entry = {
        **first,
        "runs": repeat,
        "same_every_run": all(compared(run) == first for run in runs),
        "aborted_at_exit": sum(any(rank["aborted_at_exit"] for rank in run["ranks"]) for run in runs),
    }
    return entry, [run["seconds"] for run in runs]


def describe_run(entry: dict) -> str:
    text = "raised " + "; ".join(entry["raised"]) if entry["raised"] else ("ok" if entry["ok"] else "failed")
    if entry["aborted_at_exit"]:
        text += f"; aborted at exit in {entry['aborted_at_exit']} of {entry['runs']} runs"
    return text

