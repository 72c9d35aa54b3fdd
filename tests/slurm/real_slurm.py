"""meshwise under a real SLURM (issue 43): `make test-slurm`, not part of `make test` (the file's name is not
test_*.py, so `pytest tests` does not collect it; `make test-slurm` names it). tools/slurm/start.sh installs (apt)
and starts a single-host SLURM 22.05 with two slurmd's (mwnode1, mwnode2) in a temporary folder; every test submits
real srun/sbatch jobs (the quick start under srun, the no-srun slip, cyclic placement, scancel, both
GPT examples/slurm/*.sbatch as documented for a CPU partition, scontrol requeue, and examples/slurm/requeue.sbatch
warned with SIGUSR1 as before a time limit); tools/slurm/stop.sh stops it all. Skips,
with the reason, where that cannot run (not root, no apt-get, no package access)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
JOB_ENV = {"MESHWISE_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}  # a hang fails in a minute, not ten


@pytest.fixture(scope="module")
def slurm():
    t0 = time.monotonic()
    started = subprocess.run([str(ROOT / "tools/slurm/start.sh")], capture_output=True, text=True, timeout=600)
    if started.returncode == 77:
        pytest.skip(f"no real SLURM here: {started.stderr.strip()}")
    assert started.returncode == 0, started.stderr
    env = dict(os.environ)
    for line in started.stdout.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value
    env.update(JOB_ENV)
    print(f"SLURM started in {time.monotonic() - t0:.1f} s")
    try:
        yield env
    finally:
        subprocess.run([str(ROOT / "tools/slurm/stop.sh"), env["MESHWISE_SLURM_DIR"]], timeout=120)


def _run(
    command: list[str], env: dict, timeout: float = 300, quiet: bool = False, **extra
) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    out = subprocess.run(command, cwd=ROOT, env={**env, **extra}, capture_output=True, text=True, timeout=timeout)
    if not quiet:
        print(f"{' '.join(command)}: exit {out.returncode} in {time.monotonic() - t0:.1f} s")
    return out


def _numbers(text: str) -> tuple[float, float]:
    m = re.search(r"last train loss ([\d.]+), held-out mse ([\d.]+)", text)
    assert m, text
    return float(m.group(1)), float(m.group(2))


def test_quickstart_under_srun_equals_one_process(slurm, tmp_path):
    reference = [PY, "examples/quickstart.py", "--checkpoints", str(tmp_path / "one")]
    with subprocess.Popen(reference, cwd=ROOT, env=slurm, stdout=subprocess.PIPE, text=True) as started:  # meanwhile
        # two nodes, srun's block placement: each tp pair inside a node, so no placement warning
        srun = ["srun", "-N", "2", "-n", "4", "--ntasks-per-node=2", "-m", "block", PY, "examples/quickstart.py"]
        four = _run([*srun, "--checkpoints", str(tmp_path / "srun")], slurm, MESHWISE_MESH="dp=2,tp=2")
        one = subprocess.CompletedProcess(reference, started.wait(timeout=300), started.communicate()[0], None)
    assert one.returncode == 0 and four.returncode == 0, four.stderr
    assert "mesh dp=2 x tp=2:" in four.stdout and "srun -m block" not in four.stderr, (four.stdout, four.stderr)
    (loss1, mse1), (loss4, mse4) = _numbers(one.stdout), _numbers(four.stdout)
    print(f"one process: loss {loss1} mse {mse1}; srun -n 4 dp=2 x tp=2: loss {loss4} mse {mse4}")
    assert abs(loss1 - loss4) <= 2e-6 and abs(mse1 - mse4) <= 2e-6


def _timed(command: str) -> str:
    """A batch script that runs ``command`` and prints how long it took (sbatch --wait itself polls slowly)."""
    return f'start=$(date +%s%N); {command}; echo "exit $? after $(( ($(date +%s%N) - start) / 1000000 )) ms"'


def _slip(slurm, log: Path, tasks: str, command: str) -> str:
    """Submit ``command`` as the batch script of a two-node job (no srun); returns the job id."""
    out = _run(["sbatch", "--parsable", "-N", "2", "-n", tasks, "-o", str(log), "--wrap", _timed(command)], slurm)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def _refused(log: Path) -> str:
    text = log.read_text()
    m = re.search(r"exit (\d+) after (\d+) ms", text)
    assert m, text
    print(f"{log.name}: refused in {int(m.group(2)) / 1000:.1f} s, exit {m.group(1)}")
    assert m.group(1) != "0" and int(m.group(2)) < 10_000, text
    return text


def test_python_in_a_batch_script_without_srun_is_refused_at_once(slurm, tmp_path):
    # python, and meshwise run, in the batch script of a two-node allocation: refused before any rendezvous
    run = f"{Path(PY).parent}/meshwise run --nproc-per-node 2 --mesh dp=2,tp=2 examples/quickstart.py"
    _wait_jobs(slurm, [_slip(slurm, tmp_path / "slip.out", "4", f"{PY} examples/quickstart.py")], timeout=120)
    _wait_jobs(slurm, [_slip(slurm, tmp_path / "slip-run.out", "2", run)], timeout=120)  # one at a time: timed
    text = _refused(tmp_path / "slip.out")
    assert "TopologyError" in text and "`srun -N 2 -n 4 python examples/quickstart.py`" in text, text
    text = _refused(tmp_path / "slip-run.out")
    assert "`srun -N 2 --ntasks-per-node=1 meshwise run --nproc-per-node 2" in text and "node 0 of 2" not in text


def _probe(slurm, *srun_options: str) -> list[dict]:
    out = _run(["srun", *srun_options, PY, "tests/slurm/placement_probe.py"], slurm, MESHWISE_MESH="dp=2,tp=2")
    assert out.returncode == 0, out.stderr
    return sorted(
        (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"]
    )


def test_cyclic_placement_is_warned_with_the_srun_option(slurm):
    # (-m block gives no warning: the first test's quickstart runs that way)
    cyclic = _probe(slurm, "-N", "2", "-n", "4", "--ntasks-per-node=2", "-m", "cyclic")
    assert [r["launcher"] for r in cyclic] == ["slurm"] * 4 and cyclic[0]["nodes"] == [0, 1, 0, 1], cyclic
    assert len(cyclic[0]["warnings"]) == 1 and "start the job with srun -m block" in cyclic[0]["warnings"][0]


def test_scancel_leaves_no_process_behind(slurm, tmp_path):
    log = tmp_path / "long.out"
    marker = f"meshwise-scancel-{os.getpid()}"
    wrap = f"srun -n 4 {PY} examples/quickstart.py --epochs 100000 --checkpoints {tmp_path / marker}"
    out = _run(["sbatch", "--parsable", "-n", "4", "-o", str(log), "--wrap", wrap], slurm, MESHWISE_MESH="dp=2,tp=2")
    job = out.stdout.strip().split(";")[0]
    for _ in range(120):  # training has started once the bar shows up
        if log.exists() and "epoch" in log.read_text():
            break
        time.sleep(0.5)
    running = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert len(running) >= 4, (running, log.read_text() if log.exists() else "no log")  # srun's 4 tasks at least
    t0 = time.monotonic()
    _run(["scancel", job], slurm)
    left = ""
    for _ in range(60):
        left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.strip()
        if not left:
            break
        time.sleep(0.2)
    print(f"scancel: no process left after {time.monotonic() - t0:.1f} s")
    assert not left, f"processes left after scancel: {left}"
    text = log.read_text().replace("\r", "\n")  # rank 0's one line: the signal, the job, the step, the resume
    stops = [line for line in text.splitlines() if f"meshwise: stopped by SIGTERM (SLURM job {job}) after" in line]
    assert len(stops) == 1 and "Traceback" not in text and "checkpoint saved at step" in stops[0], text[-3000:]


# --------------------------------------------------------------------------- the two sbatch examples


def _cpu_line(example: str) -> list[str]:
    """The CPU-partition command the example's header documents (``sbatch --gpus-per-node=0 ...``), as argv."""
    lines = (ROOT / example).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#   sbatch --gpus-per-node=0"))
    text = ""
    for line in lines[start:]:
        text += line.lstrip("#").strip().removesuffix("\\") + " "
        if not line.endswith("\\"):
            break
    argv = shlex.split(text)
    assert argv[0] == "sbatch" and argv[-1] == example, argv
    return argv


def _wait_jobs(slurm: dict, jobs: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = _run(["squeue", "-h", "-o", "%i", "-j", ",".join(jobs)], slurm, quiet=True).stdout.split()
        if not left:
            return
        time.sleep(0.5)
    raise AssertionError(f"jobs {jobs} still queued or running after {timeout:.0f} s")


def _summary(run_dir: Path, log: Path) -> dict:
    rows = (run_dir / "summary.jsonl").read_text().splitlines() if (run_dir / "summary.jsonl").exists() else []
    assert len(rows) == 1, log.read_text()
    return json.loads(rows[0])


def test_both_gpt_examples_run_as_documented_on_cpus_equal_to_one_process(slurm, tmp_path):
    """Each example's documented CPU line, as is (2 nodes, tp=2, a tiny GPT, a few steps on the json package's
    sources), and the srun example at 1 node x 1 task as the one-process reference: the same losses."""
    corpus = str(Path(sysconfig.get_paths()["stdlib"]) / "json")
    data = tmp_path / "data"  # each job's rank 0 tokenises it (the same bytes; files are replaced atomically)
    temp = tmp_path / "temp"  # the jobs' TMPDIR: meshwise (and torchrun under it) write nothing there
    temp.mkdir()
    env = {**slurm, "STEPS": "8", "TRAIN_ARGS": f"--source-dir {corpus} --data-dir {data}", "TMPDIR": str(temp)}
    submit = {
        "srun": _cpu_line("examples/slurm/gpt_srun.sbatch"),
        "torchrun": _cpu_line("examples/slurm/gpt_torchrun.sbatch"),
        "one": ["sbatch", "-N", "1", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1"]
        + ["--export=ALL,TP=1,SIZE=tiny", "examples/slurm/gpt_srun.sbatch"],
    }
    jobs = {}
    for name, argv in submit.items():
        log, run_dir = tmp_path / f"{name}.out", tmp_path / name
        out = _run([*argv[:-1], "--parsable", "-o", str(log), argv[-1]], env, RUN_DIR=str(run_dir))
        assert out.returncode == 0, out.stderr
        jobs[name] = out.stdout.strip().split(";")[0]
    t0 = time.monotonic()
    _wait_jobs(slurm, list(jobs.values()), timeout=240)
    print(f"the three GPT jobs ran in {time.monotonic() - t0:.1f} s")
    rows = {}
    for name in jobs:
        log, run_dir = tmp_path / f"{name}.out", tmp_path / name
        text = log.read_text()
        mesh = "dp=1xtp=1" if name == "one" else "dp=2xtp=2"
        assert f"train at {mesh} from step 0" in text and "Traceback" not in text, text
        rows[name] = _summary(run_dir, log)
        left = sorted(p.name for p in run_dir.iterdir() if p.name.startswith(("crash-", "hang-", ".meshwise-run")))
        assert left == [], (name, left)  # a clean run leaves no report, and meshwise run's index is gone
        row = rows[name]
        print(f"{name}: {text.splitlines()[0]}; train loss {row['train_loss']:.6f}, val {row['val_loss']:.6f}")
    written = sorted(p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_"))  # torch's own cache
    assert written == [], f"written to the system temp folder: {written}"  # no torchelastic_*, no meshwise-*
    for name in ("srun", "torchrun"):
        for key in ("train_loss", "val_loss", "first_val_loss"):
            assert abs(rows[name][key] - rows["one"][key]) <= 5e-5, (name, key, rows[name][key], rows["one"][key])


# --------------------------------------------------------------------------- scontrol requeue


def _stopped_and_resumed(slurm: dict, tmp_path: Path, job: str, checkpoints: Path, log: Path, stop: list, sig: str):
    """After the job's first checkpoint, ``stop`` it; while it waits to start again, train the same dp=2 mesh without
    a break. Then: every rank stopped after one step with a checkpoint and one ``stopped by SIG`` line, the job ran
    again (``run 1``), resumed there and ended with the unbroken run's numbers."""
    for _ in range(600):  # the first epoch's checkpoint
        if (checkpoints / "latest").exists():
            break
        time.sleep(0.1)
    t0 = time.monotonic()
    assert _run([*stop, job], slurm).returncode == 0
    meshwise_run = f"{Path(PY).parent}/meshwise run --nproc-per-node 2 --mesh dp=2"
    unbroken = f"{meshwise_run} examples/quickstart.py --epochs 30 --checkpoints {tmp_path / 'one'}".split()
    one = _run(unbroken, dict(os.environ))
    assert one.returncode == 0, one.stderr
    while "run 1" not in log.read_text() and time.monotonic() - t0 < 150:
        time.sleep(0.2)
    print(f"job {job} started again {time.monotonic() - t0:.1f} s after {' '.join(stop)}")
    _wait_jobs(slurm, [job], timeout=180)
    print(f"job {job} finished {time.monotonic() - t0:.1f} s after {' '.join(stop)}")
    text = log.read_text()
    assert "Traceback" not in text and "SignalException" not in text, text
    stops = [line for line in text.splitlines() if line.startswith(f"meshwise run: stopped by {sig}")]
    assert len(stops) == 1, text
    found = re.match(
        rf"meshwise run: stopped by {sig} \(SLURM job {job}\) after step (\d+) \(epoch \d+, step \d+ of 8\); "
        rf"checkpoint saved at step (\d+) in {re.escape(str(checkpoints))}\. Resume: meshwise run ",
        stops[0],
    )
    assert found and found.group(1) == found.group(2) and int(found.group(1)) < 8 * 30, stops[0]
    assert text.index("run 0") < text.index(stops[0]) < text.index("run 1"), text  # SLURM_RESTART_COUNT=1 after
    print(f"stop line: {stops[0][:120]}...")
    (loss1, mse1), (loss2, mse2) = _numbers(one.stdout), _numbers(text)
    print(f"dp=2 unbroken: loss {loss1} mse {mse1}; stopped at step {found.group(1)}: loss {loss2} mse {mse2}")
    assert (loss1, mse1) == (loss2, mse2)
    return text


def test_requeue_resumes_from_its_checkpoint_equal_to_an_uninterrupted_run(slurm, tmp_path):
    """A training job under meshwise run, submitted with --requeue, is requeued after its first checkpoint: every rank
    stops after one step with a checkpoint and one line, and the requeued run resumes there and ends with the numbers
    of the same mesh trained without a break (run while the requeued job waits for its begin time). Not one process:
    dp=2 sums its float32 gradients in another order, and the last printed digit then depends on the CPU (0.021692
    against 0.021693 on an AMD EPYC); a resume on the same mesh is exact."""
    checkpoints, log = tmp_path / "requeued", tmp_path / "requeue.out"
    meshwise_run = f"{Path(PY).parent}/meshwise run --nproc-per-node 2 --mesh dp=2"
    wrap = f'echo "run ${{SLURM_RESTART_COUNT:-0}}"; srun {meshwise_run} examples/quickstart.py --epochs 30 '
    wrap += f"--checkpoints {checkpoints}"
    options = ["--parsable", "--requeue", "--open-mode=append", "-N", "1", "-n", "1", "-c", "2", "-o", str(log)]
    job = _run(["sbatch", *options, "--wrap", wrap], slurm).stdout.strip().split(";")[0]
    _stopped_and_resumed(slurm, tmp_path, job, checkpoints, log, ["scontrol", "requeue"], "SIGTERM")


# --------------------------------------------------------------------------- the time limit's warning


def test_a_warning_before_the_time_limit_saves_and_the_example_requeues_itself(slurm, tmp_path):
    """examples/slurm/requeue.sbatch as its header's short test: SIGUSR1 to the job's steps (what --signal=USR1@120
    sends before the time limit) after the first checkpoint; every rank stops after one step with a checkpoint,
    `meshwise run` exits 138, the script requeues the job, and the next run resumes there and ends with the numbers
    of the same mesh trained without a break."""
    checkpoints, log = tmp_path / "warned", tmp_path / "warned.out"
    path = f"{Path(PY).parent}:{os.environ.get('PATH', '')}"
    export = f"--export=ALL,EPOCHS=30,CHECKPOINTS={checkpoints}"
    out = _run(["sbatch", "--parsable", "-o", str(log), export, "examples/slurm/requeue.sbatch"], slurm, PATH=path)
    job = out.stdout.strip().split(";")[0]
    text = _stopped_and_resumed(slurm, tmp_path, job, checkpoints, log, ["scancel", "--signal=USR1"], "SIGUSR1")
    assert "saved before the time limit: requeued" in text and "run 1 of job" in text, text
