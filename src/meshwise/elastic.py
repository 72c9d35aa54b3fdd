"""Elastic ``meshwise run`` (``--nnodes MIN:MAX``): a rendezvous store that no training node hosts (``meshwise
store``), torchrun c10d settings that notice a lost node within seconds, and the rule for a world the mesh's fixed
dims cannot hold (refused before launch: no node count in the range may give one)."""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import threading
from collections.abc import Collection, Sequence

from meshwise.errors import TopologyError
from meshwise.layout import Layout

__all__ = [
    "MAX_RESTARTS",
    "RENDEZVOUS_DEFAULTS",
    "elastic_range",
    "fresh_store_per_attempt",
    "node_range",
    "prepare_elastic",
    "serve_store",
]

# torchrun's c10d defaults wait 30 s (last call) for more nodes once the minimum is there, and count a node dead 15 s
# after its last heartbeat (3 x 5 s): a lost node cost the survivors ~37 s of rendezvous on loopback. These (each one
# the user gives wins) bring it to ~2 s (bench_elastic). A node is counted dead after 3 heartbeats (1 s apart) are
# missed, torch's own ratio; at 2 x 1 s an agent starved of CPU on a loaded 2-core machine was counted dead while
# alive (its world and a newcomer's then trained side by side: WorldHistory.check_owner now stops the older). The
# price of the short last call: a node that starts over a second after the others begins outside their world and
# joins it at a restart (the running world saves first: nothing is lost).
RENDEZVOUS_DEFAULTS = {"last_call_timeout": "1", "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}

_STORE_CHECK_S = 10.0  # how long meshwise run waits for `meshwise store` to answer before it refuses
MAX_RESTARTS = 3  # an elastic run's --max-restarts when none is given: torchrun's 0 ends it at the first lost node


def node_range(nnodes: object) -> tuple[int, int] | None:
    """``(MIN, MAX)`` of ``--nnodes N`` (``(N, N)``) or ``MIN:MAX``; None when they are not numbers."""
    low, _, high = str(nnodes).partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        return None


def elastic_range(args: argparse.Namespace) -> tuple[int, int] | None:
    """``(MIN, MAX)`` of ``--nnodes MIN:MAX`` when MIN < MAX, else None (a fixed node count)."""
    nodes = node_range(args.nnodes)
    return nodes if nodes is not None and nodes[1] > nodes[0] else None


def _check_worlds(args: argparse.Namespace, nodes: tuple[int, int], mesh: str, roles: str | None) -> None:
    """Every world the range allows must hold the mesh: refused before launch, naming the worlds and the fix."""
    try:
        per_node = int(args.nproc_per_node)
    except ValueError:
        return  # "gpu", "auto": known on the node only
    bad = []
    for n in range(nodes[0], nodes[1] + 1):
        try:
            Layout.resolve(mesh, n * per_node, roles)
        except TopologyError as exc:
            bad.append(f"{n} node{'s' if n != 1 else ''} = {n * per_node} ranks ({exc})")
    if bad:
        raise TopologyError(
            f"--nnodes {args.nnodes} with --nproc-per-node {per_node} allows worlds the mesh {mesh} cannot hold: "
            + "; ".join(bad)
            + ". An elastic run continues on whatever nodes are left, so every node count in the range must give a "
            "world the fixed dims divide: raise MIN, or give --nproc-per-node a multiple of the fixed dims' product "
            "(docs/cluster.md, 'Elastic runs')"
        )


def _conf(text: str | None) -> dict[str, str]:
    out = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        out[key.strip()] = value.strip()
    return out


def _check_store(endpoint: str) -> None:
    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    try:
        TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=_STORE_CHECK_S)).check(["x"])
    except Exception as exc:  # noqa: BLE001 - torch's store errors have no common type; the message says it
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TopologyError(
            f"no rendezvous store answers at {endpoint} ({first}). An elastic run (--nnodes MIN:MAX) keeps its "
            f"store outside the training nodes, so that losing any node is survivable: start `meshwise store "
            f"{endpoint}` on a machine that outlives them (a login or service node) first, or give --rdzv-conf "
            "is_host=1 to let this node host it (then losing this node ends the run)"
        ) from None


def prepare_elastic(args: argparse.Namespace, mesh: str | None, roles: str | None, given: Collection[str] = ()) -> None:
    """Check an elastic launch and fill in its rendezvous: c10d at a store no agent hosts, quick failure detection,
    and ``--max-restarts 3`` unless ``given`` (the launcher's option names) holds one."""
    nodes = elastic_range(args)
    if nodes is None:
        return
    if not {"--max-restarts", "--max_restarts"} & set(given):
        args.max_restarts = MAX_RESTARTS
    if mesh:
        _check_worlds(args, nodes, mesh, roles)
    if args.rdzv_backend != "c10d" or not args.rdzv_endpoint or args.standalone:
        raise TopologyError(
            f"--nnodes {args.nnodes} is an elastic run: give --rdzv-backend c10d --rdzv-endpoint HOST:PORT of a "
            "`meshwise store HOST:PORT` running outside the training nodes, and the same --rdzv-id on every node "
            "(docs/cluster.md, 'Elastic runs')"
        )
    conf = _conf(args.rdzv_conf)
    if "is_host" not in conf:
        _check_store(args.rdzv_endpoint)
        conf["is_host"] = "0"
    for key, value in RENDEZVOUS_DEFAULTS.items():
        conf.setdefault(key, value)
    args.rdzv_conf = ",".join(f"{k}={v}" for k, v in conf.items())


def fresh_store_per_attempt(args: argparse.Namespace) -> None:
    """On several nodes, each attempt's rank-0 worker hosts a fresh world store (torchrun's own opt-out of the
    shared store, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; one the user exported wins).

    torchrun 2.13 serves the workers' store from the rank-0 agent and keeps its address from the first round: a node
    that joins a later round waits 60 s for an address nobody writes again, and both agents fail. And that store
    outlives a restart, holding the last attempt's gloo addresses, so ``meshwise.init`` would have to key its keys
    on the attempt, which torchrun counts per node: a node that restarts for another node's failure counts one
    less, its ranks never meet the others, and every restart fails the same way."""
    nodes = node_range(args.nnodes)
    if nodes is not None and nodes[1] > 1:
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def serve_store(argv: Sequence[str]) -> int:
    """``meshwise store HOST:PORT``: serve an elastic run's rendezvous store until SIGINT or SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="meshwise store",
        description="Serve the c10d rendezvous store of elastic runs (meshwise run --nnodes MIN:MAX --rdzv-backend "
        "c10d --rdzv-endpoint HOST:PORT) on a machine that is not a training node, so that any node can be lost. "
        "Runs until SIGINT or SIGTERM; one store serves many jobs (each its own --rdzv-id).",
    )
    parser.add_argument("endpoint", help="HOST:PORT the nodes reach it at (HOST: this machine's address)")
    args = parser.parse_args(list(argv))
    host, _, port = args.endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise TopologyError(f"meshwise store needs HOST:PORT, got {args.endpoint!r}: e.g. meshwise store 0.0.0.0:29400")
    from torch.distributed import TCPStore

    try:
        store = TCPStore(
            host,
            int(port),
            is_master=True,
            multi_tenant=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(days=365),
        )
    except Exception as exc:  # noqa: BLE001 - torch's store errors have no common type; the message says it
        raise TopologyError(f"cannot serve a store at {args.endpoint} ({exc}): choose a free port") from None
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    print(
        f"meshwise store: serving the rendezvous at {args.endpoint} (pid {os.getpid()}); stop with Ctrl-C", flush=True
    )
    while not done.wait(1.0):
        pass
    del store
    print("meshwise store: stopped", file=sys.stderr, flush=True)
    return 0
