"""The ``meshwise`` command line: ``run`` (torchrun with a mesh, SLURM-aware; ``--dry-run`` plays one rank of a
planned world in this process), ``describe``, ``plot``, ``report`` and ``export`` (one plain state_dict file from a
checkpoint)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import runpy
import shlex
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from meshwise.elastic import fresh_store_per_attempt, node_range, prepare_elastic, serve_store
from meshwise.environment import (
    DRY_RUN_VARIABLE,
    DryRunSpec,
    dry_run_spec,
    slurm_job,
    slurm_master_addr,
    slurm_master_port,
    slurm_srun_step,
    srun_advice,
)
from meshwise.errors import MeshwiseError, TopologyError
from meshwise.layout import Layout
from meshwise.run_end import failure_story, stop_signal, stopped

# The command line imports the layers a command needs inside that command (the imports inside functions below):
# `meshwise run` must start torchrun without loading torch.distributed, the engine or matplotlib first.

__all__ = ["COMMANDS", "main", "parse_run_args"]

_RUN_HELP = """\
usage: meshwise run [options] SCRIPT.py [script arguments]      (or: meshwise run [options] -m MODULE ...)

Run SCRIPT on every process of a mesh, with torchrun underneath. The script is checked before any process
starts; a failed run ends with its first error (which rank, the message, where); Ctrl-C, SIGTERM or SIGUSR1
stops every rank after the same step (a checkpoint first, where Checkpointing is attached) and ends with the
command that resumes it (SIGUSR1, a scheduler's warning before its kill: exit code 138, "requeue me").

meshwise options:
  --nproc-per-node N          processes on this node (default 1)
  --mesh SPEC                 mesh sizes, e.g. dp=-1,tp=2, read by meshwise.init() (exported as MESHWISE_MESH);
                              a different mesh given to meshwise.init() in the script is an error
  --roles SPEC                roles of dims without a default, e.g. space=split
  --timeout SECONDS           collective timeout (default 600)
  --dry-run --world-size N --rank R
                              play one rank of a planned world in this process (docs/dryrun.md)

"""

_MULTI_NODE_HELP = """\
several nodes (run the same command on every node; docs/cluster.md, "meshwise run"):
  --nnodes N                  number of nodes; MIN:MAX for an elastic job, which goes on when nodes are lost or
                              join (restarting from the latest checkpoint; every count in the range must hold the
                              mesh), with its store served by `meshwise store HOST:PORT` off the training nodes
  --rdzv-backend c10d         rendezvous through a TCP store that the node at the endpoint hosts
  --rdzv-endpoint HOST:PORT   that node's address, the same on every node
  --rdzv-id ID                a job id, the same on every node and different for every job
  --node-rank K               with --rdzv-backend static (and --master-addr/--master-port) only;
                              c10d gives the nodes their ranks itself, in the order of their addresses
  --max-restarts N            after a worker fails, restart every worker of every node up to N times (torchrun's
                              default 0; 3 for an elastic --nnodes MIN:MAX)
  --local-addr ADDR           the address the other nodes reach this node at, when the hostname
                              does not resolve to it (several network interfaces, containers)

Without any of these on one node, meshwise run rendezvouses on a free port (torchrun --standalone).
Inside a SLURM allocation of several nodes (srun --ntasks-per-node 1 meshwise run ...), --nnodes,
--node-rank and a c10d rendezvous at the step's first node default to SLURM's values.

Every other torchrun option is accepted and reaches torchrun unchanged: meshwise run --help-torchrun lists them.
"""

# torchrun's log lines that meshwise run's own summary replaces (a failed run's story, a stop's one line).
_TORCHRUN_NOISE = (
    "Sending process %s closing signal",
    "Closing process %s via signal",
    "Received %s death signal",
    "failed (exitcode: %s)",
    "Got termination signal",
)
_TORCHRUN_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
)

# Options that say where to rendezvous: given any of them, torchrun's own rules apply, never --standalone.
_RENDEZVOUS_OPTIONS = (
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--rdzv-conf",
    "--standalone",
)


def _run_parser() -> argparse.ArgumentParser:
    from torch.distributed import run as torchrun

    parser = torchrun.get_args_parser()
    parser.prog = "meshwise run"
    parser.description = (
        "Run a script under torch.distributed.run (torchrun) with a declared mesh. Every torchrun option "
        "works (--nproc-per-node, --nnodes, --rdzv-endpoint, --max-restarts, ...) and reaches torchrun unchanged."
    )
    parser.epilog = _MULTI_NODE_HELP
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--mesh", default=None, help="mesh sizes, e.g. dp=-1,tp=2 (exported as MESHWISE_MESH)")
    parser.add_argument("--roles", default=None, help="roles of dims without a default, e.g. space=split")
    parser.add_argument("--timeout", default=None, type=float, help="collective timeout in seconds")
    return parser


def parse_run_args(argv: Sequence[str], env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """The torchrun arguments ``meshwise run`` hands to ``torch.distributed.run.run`` for ``argv``.

    torchrun's options pass through as parsed by torchrun's own parser; meshwise only adds
    ``--standalone`` on one node with no rendezvous given, and SLURM's node count, node rank and
    rendezvous inside a multi-node allocation. ``env`` defaults to ``os.environ``.
    """
    env = os.environ if env is None else env
    parser = _run_parser()
    args = parser.parse_args(list(argv))
    _fill_from_slurm(args, env, argv)
    _standalone_by_default(args, argv, parser, env)
    return args


def _run(argv: Sequence[str]) -> int:
    from torch.distributed import run as torchrun

    tokens = _launcher_tokens(argv)
    if "--help-torchrun" in tokens:
        _run_parser().print_help()
        return 0
    if "-h" in tokens or "--help" in tokens or not argv:
        print(_RUN_HELP + _MULTI_NODE_HELP, end="")
        return 0
    if "--dry-run" in tokens:
        return _dry_run(argv)
    args = parse_run_args(argv)
    problem = _script_problem(args)
    if problem:
        print(f"meshwise run: error: {problem}", file=sys.stderr)
        return 2
    if args.mesh is not None:
        world = _planned_world(args)
        if world:
            Layout.resolve(args.mesh, world, args.roles)  # a bad mesh fails here, before any process starts
        os.environ["MESHWISE_MESH"] = args.mesh
    if args.roles is not None:
        os.environ["MESHWISE_ROLES"] = args.roles
    prepare_elastic(args, os.environ.get("MESHWISE_MESH"), os.environ.get("MESHWISE_ROLES"), tokens)
    fresh_store_per_attempt(args)
    if args.timeout is not None:
        os.environ["MESHWISE_TIMEOUT"] = str(args.timeout)
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from meshwise.debug.crash import INDEX_VARIABLE
    from meshwise.slurm_rendezvous import HostedRendezvous

    if "OMP_NUM_THREADS" not in os.environ and str(args.nproc_per_node) not in ("1", "cpu"):
        os.environ["OMP_NUM_THREADS"] = "1"  # torchrun's own default, set here without its 4-line banner
    hosted = HostedRendezvous(args, host=args.slurm_host) if hasattr(args, "slurm_host") else None  # else torchrun's
    # Each rank names its crash report and error here, rank 0 what a stop left: the last lines come from them. So
    # does torchrun's folder (else left in the system temp folder) unless --log-dir, --redirects or --tee want it.
    index = _launcher_folder()
    os.environ[INDEX_VARIABLE] = str(index)
    if args.log_dir is None and args.redirects == "0" and args.tee == "0":
        args.log_dir = str(index / "torchrun")
    noise = _QuietTorchrun()
    command = shlex.join(["meshwise", "run", *argv])
    # torchrun's agent stops its workers on the signals it handles (--signals-to-handle), with the same signal:
    # SIGUSR1 (a scheduler's warning before the kill, SLURM's --signal=USR1@120) joins its defaults, so every rank
    # saves and ends with 138; a list the user gave is kept
    if getattr(args, "signals_to_handle", None) == "SIGTERM,SIGINT,SIGHUP,SIGQUIT":
        args.signals_to_handle += ",SIGUSR1"
    try:
        torchrun.run(args)
        if hosted is not None:
            hosted.finish()
    except SignalException as exc:
        return stopped(index, int(exc.sigval), command)
    except KeyboardInterrupt:  # before torchrun took over the signals
        return stopped(index, signal.SIGINT, command)
    except ChildFailedError as exc:
        if hosted is not None:
            hosted.finish()
        sig = stop_signal(index, {f.exitcode for f in exc.failures.values()})
        if sig is not None:  # the ranks got the signal directly (scancel, srun, --signal) and stopped
            return stopped(index, sig, command)
        print(failure_story(exc, index), file=sys.stderr, flush=True)
        return 1
    finally:
        noise.remove()
        shutil.rmtree(index, ignore_errors=True)
    return 0


def _launcher_folder() -> Path:
    """``RUN_DIR/.meshwise-run-HOST-PID``: this launcher's index of the ranks' reports, in the run folder."""
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in os.uname().nodename)
    folder = Path(os.environ.get("MESHWISE_RUN_DIR") or "runs").absolute() / f".meshwise-run-{host}-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)  # a folder of a killed launcher whose pid this one got
    try:
        folder.mkdir(parents=True)
    except OSError as exc:
        raise MeshwiseError(
            f"cannot create {folder} ({exc.strerror}): crash and hang reports go to the run folder "
            "(MESHWISE_RUN_DIR, else runs/ here); make it writable or set MESHWISE_RUN_DIR"
        ) from None
    return folder


class _QuietTorchrun(logging.Filter):
    """Drops torchrun's lines about closing workers: meshwise run says what happened in its own last lines."""

    def __init__(self) -> None:
        super().__init__()
        for name in _TORCHRUN_LOGGERS:
            logging.getLogger(name).addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(str(record.msg).startswith(text) for text in _TORCHRUN_NOISE)

    def remove(self) -> None:
        for name in _TORCHRUN_LOGGERS:
            logging.getLogger(name).removeFilter(self)


def _script_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the script before any worker starts: missing, not a file, or not valid Python."""
    script = args.training_script
    if args.module:
        if importlib.util.find_spec(script.split(".")[0]) is None:
            return f"no module named {script.split('.')[0]!r} (for -m {script}) on this Python's path"
        return None
    if args.no_python:
        if shutil.which(script) is None and not os.access(script, os.X_OK):
            return f"{script!r} is not an executable on PATH or a path to one (given with --no-python)"
        return None
    if not os.path.exists(script):
        return f"script {script!r} not found (working directory {os.getcwd()}): check the path"
    if not os.path.isfile(script):
        return f"script {script!r} is not a file"
    try:
        with open(script, "rb") as f:
            compile(f.read(), script, "exec")
    except SyntaxError as exc:
        return f"{script}:{exc.lineno}: {exc.msg}: the script is not valid Python, so no process was started"
    except (OSError, ValueError) as exc:
        return f"cannot read script {script!r}: {exc}"
    return None


def _launcher_tokens(argv: Sequence[str]) -> list[str]:
    """The tokens before the script (a ``.py`` path or ``-m``): the script's own options are its business."""
    out = []
    for token in argv:
        if token == "-m" or token.endswith(".py"):
            break
        out.append(token.split("=", 1)[0])
    return out


def _dry_run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshwise run --dry-run",
        description="Run the script unchanged in this one process as rank --rank of a world of --world-size on "
        "torch's fake backend (no communication), then print what that rank holds, reads and would write "
        "(docs/dryrun.md).",
    )
    parser.add_argument("--dry-run", action="store_true", required=True)
    parser.add_argument("--world-size", type=int, required=True, help="ranks of the planned job")
    parser.add_argument("--rank", type=int, required=True, help="the rank this process plays")
    parser.add_argument("--nproc-per-node", type=int, default=None, help="ranks per node (default min(8, world))")
    parser.add_argument("--dry-run-steps", type=int, default=2, help="trainer steps to run (default 2)")
    parser.add_argument("--report-json", default=None, help="also write the report's facts to this JSON file")
    parser.add_argument("--mesh", default=None, help="mesh sizes, e.g. dp=-1,tp=2 (exported as MESHWISE_MESH)")
    parser.add_argument("--roles", default=None, help="roles of dims without a default, e.g. space=split")
    parser.add_argument("--timeout", default=None, type=float, help="collective timeout in seconds")
    parser.add_argument("training_script", help="the script, run unchanged")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def _dry_run(argv: Sequence[str]) -> int:
    """``meshwise run --dry-run``: the script as one rank of a planned world; the report on stdout."""
    import torch

    from meshwise import dryrun, topology

    args = _dry_run_parser().parse_args(list(argv))
    per_node = args.nproc_per_node or min(8, max(args.world_size, 1))
    spec = DryRunSpec(args.rank, args.world_size, per_node, args.dry_run_steps)
    planned = {DRY_RUN_VARIABLE: spec.text()}
    dry_run_spec(planned)  # a rank outside the world fails here, as under a real launcher
    if args.mesh is not None:
        Layout.resolve(args.mesh, args.world_size, args.roles)  # a bad mesh fails here, as before a real launch
        planned["MESHWISE_MESH"] = args.mesh
    for variable, value in (("MESHWISE_ROLES", args.roles), ("MESHWISE_TIMEOUT", args.timeout)):
        if value is not None:
            planned[variable] = str(value)
    # The plan is this process's environment while the script runs, and only then (a caller's is restored).
    saved_env = {k: os.environ.get(k) for k in planned}
    os.environ.update(planned)
    recorder = dryrun.begin(spec.steps)
    saved_argv, saved_path, saved_dtype = list(sys.argv), list(sys.path), torch.get_default_dtype()
    sys.argv = [args.training_script, *args.training_script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.training_script)))
    code = 0
    try:
        runpy.run_path(args.training_script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv, sys.path = saved_argv, saved_path
        torch.set_default_dtype(saved_dtype)  # a script's torch.set_default_dtype ends with it, as in its process
        topology.shutdown()  # a script that did not call meshwise.shutdown() leaves the fake group here
        dryrun.end()
        dryrun.leave_ignite()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    print(recorder.report(), flush=True)
    if args.report_json:
        with open(args.report_json, "w") as f:
            json.dump(recorder.facts(), f, indent=1)
    return code


def _options_given(argv: Sequence[str], args: argparse.Namespace, parser: argparse.ArgumentParser) -> set[str]:
    """The launcher options on the command line (before the script), by their dashed long name.

    Tokens are read as written (``--rdzv_id=x`` counts as ``--rdzv-id``); an option whose parsed value
    differs from torchrun's default counts too, which covers argparse's abbreviations (``--rdzv-end``).
    """
    given = set()
    for token in argv:
        if token == args.training_script:
            break
        if token.startswith("--"):
            given.add(token.split("=", 1)[0].replace("_", "-"))
    for action in parser._actions:
        long_names = [o for o in action.option_strings if o.startswith("--")]
        if long_names and action.dest != "help" and getattr(args, action.dest, None) != action.default:
            given.add(long_names[0].replace("_", "-"))
    return given


def _single_node(nnodes: object) -> bool:
    return node_range(nnodes) == (1, 1)


def _standalone_by_default(
    args: argparse.Namespace, argv: Sequence[str], parser: argparse.ArgumentParser, env: Mapping[str, str]
) -> None:
    """One node and no rendezvous given: rendezvous on a free port (torchrun --standalone).

    torchrun's own default is 127.0.0.1:29500, so two single-node jobs on one machine (two users, or a
    job and its tests) collide and fail in confusing ways. Several nodes, or any rendezvous option (even
    only ``--rdzv-id`` or ``--node-rank``), keep torchrun's rules: --standalone would replace the
    rendezvous with one of its own and the nodes would never meet.
    """
    if not _single_node(args.nnodes) or args.standalone:
        return
    if set(_RENDEZVOUS_OPTIONS) & _options_given(argv, args, parser):
        return
    args.standalone = True


def _planned_world(args: argparse.Namespace) -> int | None:
    """World size when both node and process counts are fixed numbers, so a bad mesh fails before launch."""
    nodes = node_range(args.nnodes)
    if nodes is None or nodes[0] != nodes[1]:
        return None  # an elastic range: the world size is known only at rendezvous
    try:
        return nodes[0] * int(args.nproc_per_node)
    except ValueError:
        return None


def _fill_from_slurm(args: argparse.Namespace, env: Mapping[str, str], argv: Sequence[str] = ()) -> None:
    """Inside a SLURM step on several nodes with no --nnodes given: one meshwise run per node meets the others."""
    job = slurm_job(env)
    if job is None or job.num_nodes <= 1 or str(args.nnodes) != "1:1":
        return
    if not slurm_srun_step(env):  # the batch script runs on the first node only: the others would never join
        raise TopologyError(
            f"SLURM job {job.job_id} has {job.num_nodes} nodes but this meshwise run was not started by srun (no "
            "SLURM_STEP_ID: it is the batch script, on the first node only), so it would wait for nodes that never "
            f"join. Start one meshwise run per node: `{srun_advice(env, list(argv), meshwise_run=True)}`"
        )
    args.nnodes = str(job.num_nodes)
    if args.rdzv_endpoint == "":  # c10d at the step's first node; its launcher hosts the store (slurm_rendezvous)
        master = slurm_master_addr(env)
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = f"{master}:{slurm_master_port(env)}"
        if args.rdzv_id == "none":
            args.rdzv_id = f"slurm-{job.job_id}"
        if not env.get("MASTER_ADDR"):  # the list's first node: this one? (else torchrun decides who hosts)
            args.slurm_host = env.get("SLURMD_NODENAME", master if job.node_rank == 0 else "") == master
    else:  # the user's rendezvous: --node-rank counts with --rdzv-backend static
        args.node_rank = job.node_rank
    print(
        f"meshwise run: SLURM job {job.job_id}, node {job.node_rank} of {job.num_nodes}, rendezvous at "
        f"{args.rdzv_endpoint}",
        flush=True,
    )


def _describe(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="meshwise describe",
        description="Print the rank -> coordinate table of a mesh without starting it. With --nproc-per-node, "
        "ranks are placed on nodes as torchrun and srun number them (node by node), the table shows each rank's "
        "node and a tensor-, domain- or pipeline-parallel dim that crosses nodes needlessly is pointed out.",
    )
    parser.add_argument("--mesh", required=True, help="mesh sizes, e.g. dp=-1,tp=2")
    parser.add_argument("--world-size", type=int, default=None, help="number of processes to plan for")
    parser.add_argument("--nproc-per-node", type=int, default=None, help="processes on each node")
    parser.add_argument("--nnodes", type=int, default=None, help="number of nodes (world size = nnodes x nproc)")
    parser.add_argument("--roles", default=None, help="roles of dims without a default, e.g. space=split")
    parser.add_argument("--all-ranks", action="store_true", help="a row per rank (the default up to 64 ranks)")
    args = parser.parse_args(list(argv))
    world, per_node = args.world_size, args.nproc_per_node
    if world is None and args.nnodes is not None and per_node is not None:
        world = args.nnodes * per_node
    if world is None:
        parser.error("give --world-size, or --nnodes with --nproc-per-node")
    if args.nnodes is not None and per_node is not None and args.nnodes * per_node != world:
        parser.error(f"--nnodes {args.nnodes} x --nproc-per-node {per_node} is not --world-size {world}")
    if per_node is not None and (per_node < 1 or world % per_node):
        parser.error(f"--world-size {world} is not a whole number of nodes of --nproc-per-node {per_node}")
    layout = Layout.resolve(args.mesh, world, args.roles)
    nodes = [r // per_node for r in range(world)] if per_node else None
    print(layout.table(nodes) if args.all_ranks or world <= 64 else layout.summary(nodes))
    return 0


def _plot(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshwise plot", description="Render a run's loss and metric curves.")
    parser.add_argument("run_dir", help="run folder holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
    parser.add_argument("--smooth", default=0.6, type=float, help="smoothing weight in [0, 1), 0 = raw (default 0.6)")
    args = parser.parse_args(list(argv))
    from meshwise.plot import plot_run

    print(plot_run(args.run_dir, args.out, smooth=args.smooth))
    return 0


def _report(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshwise report", description="Sum up a run folder on one screen.")
    parser.add_argument("run_dir", help="run folder holding metrics.jsonl (and checkpoints)")
    args = parser.parse_args(list(argv))
    from meshwise.report import report_text

    print(report_text(args.run_dir))
    return 0


def _export(argv: Sequence[str]) -> int:
    from meshwise.checkpoint.export import run_cli

    return run_cli(list(argv), prog="meshwise export")


COMMANDS = {
    "run": _run,
    "store": serve_store,
    "describe": _describe,
    "plot": _plot,
    "report": _report,
    "export": _export,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meshwise`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        from meshwise.version import __version__

        print(f"meshwise {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(
            "usage: meshwise {run,store,describe,plot,report,export} ...\n\n"
            "  run       torchrun a script with a mesh:  meshwise run --nproc-per-node 4 --mesh dp=-1,tp=2 train.py\n"
            "            or play one rank of a big job:  meshwise run --dry-run --world-size 1024 --rank 5 "
            "--mesh dp=-1,tp=8 train.py\n"
            "  store     an elastic run's rendezvous:    meshwise store 0.0.0.0:29400   (off the training nodes)\n"
            "  describe  plan a mesh:                    meshwise describe --mesh dp=-1,tp=2 --world-size 8 "
            "--nproc-per-node 4\n"
            "  plot      draw a run's curves:            meshwise plot runs/gpt\n"
            "  report    a run on one screen:            meshwise report runs/gpt\n"
            "  export    one plain state_dict file:      meshwise export runs/gpt/checkpoints model.pt\n"
            "            or a Hugging Face folder:       meshwise export runs/gpt/checkpoints hf/ --hf "
            "--config config.json\n"
            "  --version print the version\n\n"
            "meshwise COMMAND --help: a command's options",
            file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except MeshwiseError as exc:
        print(f"meshwise {argv[0]}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
