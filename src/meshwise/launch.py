"""The ``meshwise`` command line: ``run`` (torchrun with a mesh, SLURM-aware), ``describe`` and ``plot``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from meshwise.errors import MeshwiseError
from meshwise.topology import Layout, _first_slurm_host


def _run(argv: Sequence[str]) -> int:
    from torch.distributed import run as torchrun

    parser = torchrun.get_args_parser()
    parser.prog = "meshwise run"
    parser.description = (
        "Run a script under torch.distributed.run (torchrun) with a declared mesh. Every torchrun option "
        "works (--nproc-per-node, --nnodes, --rdzv-endpoint, --max-restarts, ...). Inside a SLURM "
        "allocation of several nodes, --nnodes, --node-rank and the rendezvous default to SLURM's values."
    )
    parser.add_argument("--mesh", default=None, help="mesh sizes, e.g. dp=-1,tp=2 (exported as MESHWISE_MESH)")
    parser.add_argument("--roles", default=None, help="roles of dims without a default, e.g. space=split")
    parser.add_argument("--timeout", default=None, type=float, help="collective timeout in seconds")
    args = parser.parse_args(list(argv))
    _standalone_by_default(args, argv)
    if args.mesh is not None:
        world = _planned_world(args)
        if world:
            Layout.resolve(args.mesh, world, args.roles)  # a bad mesh fails here, before any process starts
        os.environ["MESHWISE_MESH"] = args.mesh
    if args.roles is not None:
        os.environ["MESHWISE_ROLES"] = args.roles
    if args.timeout is not None:
        os.environ["MESHWISE_TIMEOUT"] = str(args.timeout)
    _fill_from_slurm(args)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        return 1
    return 0


def _standalone_by_default(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """One node and no rendezvous given: rendezvous on a free port (torchrun --standalone).

    torchrun's own default is 127.0.0.1:29500, so two single-node jobs on one machine (two users, or a
    job and its tests) collide and fail in confusing ways. Any explicit address keeps torchrun's rules.
    """
    options = set()
    for token in argv:
        if token == args.training_script:
            break
        options.add(token.split("=", 1)[0].replace("_", "-"))
    explicit = {"--master-port", "--master-addr", "--rdzv-endpoint", "--rdzv-backend", "--standalone", "--nnodes"}
    multi_node_slurm = "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NNODES", "1")) > 1
    if not options & explicit and not multi_node_slurm:
        args.standalone = True


def _planned_world(args: argparse.Namespace) -> int | None:
    """World size when both node and process counts are fixed numbers, so a bad mesh fails before launch."""
    low, _, high = str(args.nnodes).partition(":")
    try:
        nnodes = int(low)
        if high and int(high) != nnodes:
            return None  # elastic range: the world size is known only at rendezvous
        nproc = int(args.nproc_per_node)
    except ValueError:
        return None
    return nnodes * nproc


def _fill_from_slurm(args: argparse.Namespace) -> None:
    env = os.environ
    if "SLURM_JOB_ID" not in env or int(env.get("SLURM_NNODES", "1")) <= 1 or str(args.nnodes) != "1:1":
        return
    args.nnodes = env["SLURM_NNODES"]
    args.node_rank = int(env.get("SLURM_NODEID", "0"))
    if args.rdzv_endpoint == "":
        args.rdzv_backend = "c10d"
        host = _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        args.rdzv_endpoint = f"{host}:{env.get('MASTER_PORT', '29500')}"
        args.rdzv_id = env["SLURM_JOB_ID"]
    print(f"meshwise run: SLURM allocation of {args.nnodes} nodes, rendezvous at {args.rdzv_endpoint}", flush=True)


def _describe(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="meshwise describe", description="Print the rank -> coordinate table of a mesh without starting it."
    )
    parser.add_argument("--mesh", required=True, help="mesh sizes, e.g. dp=-1,tp=2")
    parser.add_argument("--world-size", type=int, required=True, help="number of processes to plan for")
    parser.add_argument("--roles", default=None, help="roles of dims without a default, e.g. space=split")
    args = parser.parse_args(list(argv))
    print(Layout.resolve(args.mesh, args.world_size, args.roles).table())
    return 0


def _plot(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshwise plot", description="Render a run's loss and metric curves.")
    parser.add_argument("run_dir", help="run folder holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
    args = parser.parse_args(list(argv))
    from meshwise.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


COMMANDS = {"run": _run, "describe": _describe, "plot": _plot}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meshwise`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(
            "usage: meshwise {run,describe,plot} ...\n\n"
            "  run       torchrun a script with a mesh:  meshwise run --nproc-per-node 4 --mesh dp=-1,tp=2 train.py\n"
            "  describe  plan a mesh:                    meshwise describe --mesh dp=-1,tp=2 --world-size 8\n"
            "  plot      draw a run's curves:            meshwise plot runs/gpt",
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
