"""Real torchrun agents on loopback for elastic runs: a `meshwise store`, `meshwise run --nnodes 1:2` agents of
examples/elastic/train.py, a node lost by killing an agent's whole process tree, the one-process reference. Shared by
tests/elastic/real_agents.py and benchmarks/bench_elastic.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "elastic" / "train.py"
PY = sys.executable
ENV = {"MESHWISE_TIMEOUT": "60", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # a hang fails in a minute


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def store() -> Iterator[str]:
    """A `meshwise store` on a free loopback port, stopped (SIGTERM) at the end; yields its HOST:PORT."""
    endpoint = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [PY, "-m", "meshwise.launch", "store", endpoint], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        line = proc.stdout.readline()
        assert "serving the rendezvous" in line, line
        yield endpoint
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def train_args(run_dir: Path, steps: int, step_seconds: float, out: Path | None = None) -> list[str]:
    args = [str(EXAMPLE), "--run-dir", str(run_dir), "--steps", str(steps), "--step-seconds", str(step_seconds)]
    return args + (["--out", str(out)] if out else [])


def agent(
    endpoint: str, run_id: str, script_args: list[str], log: Path, *launcher: str, mesh: str = "dp=-1,tp=2"
) -> subprocess.Popen:
    """One node: `meshwise run --nnodes 1:2 --nproc-per-node 2 [launcher options]` in a session of its own."""
    cmd = [PY, "-m", "meshwise.launch", "run", "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3"]
    cmd += list(launcher)
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--mesh", mesh]
    env = {**os.environ, **ENV, "MESHWISE_RUN_DIR": str(log.parent / f"{log.stem}-reports"), "LOGLEVEL": "INFO"}
    with open(log, "w") as f:
        return subprocess.Popen(
            cmd + script_args, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )


def tree(pid: int) -> list[int]:
    """``pid`` and every process under it, parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def lose_node(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> float:
    """``sig`` to the agent and every process under it (its workers run in sessions of their own): SIGKILL, a node
    gone; SIGSTOP, a node that hangs (its processes alive, its sockets open, nothing answering)."""
    pids = tree(proc.pid)
    t = time.monotonic()
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)
    if sig == signal.SIGKILL:
        proc.wait(timeout=30)
    return t


def group_rank(log: Path) -> int | None:
    """The node rank torchrun's rendezvous gave this agent last (its INFO log: ``group_rank=K``)."""
    found = re.findall(r"group_rank=(\d+)", log.read_text(errors="replace"))
    return int(found[-1]) if found else None


def reached(run_dir: Path) -> int:
    """The last step the run's current world completed (meshwise.engine.worlds), 0 before the first."""
    with contextlib.suppress(OSError, ValueError):
        return int((run_dir / ".reached-step").read_text())
    return 0


def wait_for_step(
    run_dir: Path, step: int, procs: list[subprocess.Popen], world: int | None = None, timeout: float = 180
) -> None:
    """Until the run reached ``step`` (in a world of ``world`` ranks, when given: two agents started together may
    first meet as two worlds, with the short last call, and join at a restart)."""
    deadline = time.monotonic() + timeout

    def there() -> bool:
        if reached(run_dir) < step:
            return False
        with contextlib.suppress(OSError, ValueError, IndexError):
            return world is None or worlds(run_dir)[-1]["world_size"] == world
        return False

    while not there():
        assert time.monotonic() < deadline, f"step {step} not reached in {timeout:.0f} s (at {reached(run_dir)})"
        assert all(p.poll() is None for p in procs), "an agent ended before the step"
        time.sleep(0.05)


def finish(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 240) -> list[str]:
    """Wait for every agent (killed at the timeout); their logs."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                for pid in tree(p.pid):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                p.wait()
    return [log.read_text() for log in logs]


def reference(tmp: Path, steps: int) -> list[float]:
    """The uninterrupted one-process run's final weights."""
    out = tmp / "reference.json"
    subprocess.run(
        [PY, *train_args(tmp / "reference", steps, 0.0, out)],
        check=True,
        env={**os.environ, **ENV},
        cwd=ROOT,
        timeout=120,
        capture_output=True,
    )
    return json.loads(out.read_text())["weights"]


def worlds(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "worlds.jsonl").read_text().splitlines()]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))
