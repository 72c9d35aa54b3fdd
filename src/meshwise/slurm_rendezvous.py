"""The c10d rendezvous store of a multi-node ``meshwise run`` inside SLURM, hosted by the first node's launcher itself.

torchrun's c10d rendezvous keeps its TCP store in the agent of the node at the endpoint. That agent returns as soon
as the exit barrier lets it through, and its store goes with it, while the other nodes' agents still read the barrier
and close the rendezvous through that store: each then logs "Error waiting on exit barrier" with a traceback and
"failed to shutdown the rendezvous", at the end of a run that went well (seen on a real SLURM, 2 nodes). Where
``meshwise run`` chose the rendezvous (SLURM's first node, ``docs/cluster.md``), node 0's launcher hosts the store
before torchrun starts, every agent joins it as a client (``--rdzv-conf is_host=0``), and at the end each node's
launcher counts itself out: node 0's waits for the others (at most ``wait_s``) before its store goes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import time

from meshwise.errors import TopologyError

__all__ = ["HostedRendezvous"]

_DONE_KEY = "meshwise/launchers-done"


class HostedRendezvous:
    """The store of the c10d rendezvous ``args`` names (``HOST:PORT``), hosted here where ``host`` (node 0)."""

    def __init__(self, args: argparse.Namespace, host: bool, timeout_s: float = 600.0) -> None:
        from torch.distributed import TCPStore

        address, _, port = str(args.rdzv_endpoint).rpartition(":")
        self.address, self.port, self.nodes = address, int(port), int(str(args.nnodes).split(":")[-1])
        self.server = None
        if host:
            try:
                self.server = TCPStore(
                    address,
                    self.port,
                    is_master=True,
                    multi_tenant=True,
                    wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s),
                )
            except Exception as exc:  # noqa: BLE001 - torch's store errors have no common type; the message says it
                raise TopologyError(
                    f"meshwise run cannot host the rendezvous at {args.rdzv_endpoint} ({exc}): export MASTER_PORT="
                    "<a free port> in the batch script, so that every node uses it"
                ) from None
        conf = str(args.rdzv_conf or "")
        args.rdzv_conf = f"{conf},is_host=0" if conf else "is_host=0"  # every agent a client, node 0's too

    def finish(self, wait_s: float = 30.0) -> None:
        """Count this node's launcher out (its agent is done with the store); node 0 waits for every node's."""
        from torch.distributed import TCPStore

        with contextlib.suppress(Exception):  # a node that is gone has nothing left to say
            if self.server is None:
                TCPStore(self.address, self.port, is_master=False, timeout=datetime.timedelta(seconds=5)).add(
                    _DONE_KEY, 1
                )
                return
            self.server.add(_DONE_KEY, 1)
            deadline = time.monotonic() + wait_s
            while self.server.add(_DONE_KEY, 0) < self.nodes and time.monotonic() < deadline:
                time.sleep(0.05)
