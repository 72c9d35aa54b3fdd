"""No silent hangs: the debug base service, just above the topology (layer 2; imported by metrics and the engine).

Collectives that go wrong name their mesh dims, roles, op, step, call site and missing ranks.
:mod:`meshwise.debug.watchdog` knows what this rank is in (:func:`guarded`) and reports hangs with every
rank's stacks; :mod:`meshwise.debug.fingerprint` is debug mode, which compares each collective's fingerprint
across its group before it runs. :func:`attach` and :func:`detach` are registered once, in
``meshwise/__init__.py``, as the topology's init and shutdown hooks (``meshwise.topology.on_init``/``on_shutdown``).
"""

from __future__ import annotations

import atexit
import sys
import traceback

from meshwise.debug import crash, interrupt
from meshwise.debug.fingerprint import COLLECTIVE_OPS, install, uninstall
from meshwise.debug.watchdog import Call, describe, guarded, start, stop
from meshwise.topology import Topology

__all__ = ["COLLECTIVE_OPS", "Call", "attach", "describe", "detach", "guarded", "install", "uninstall"]

# Under meshwise run (or run_distributed) each rank's uncaught error goes to the launcher, which ends a failed
# run with the first one; from import on, so that an error in meshwise.init itself is told too.
crash.install_launch_hook()


def attach(topo: Topology) -> None:
    """Start the watchdog for a new topology and, in debug mode, wrap the collectives (an init hook)."""
    if topo.environment.launcher == "dry-run":
        return  # no peers to ask and nothing to hang on: the fake backend's store holds no keys
    start(topo)
    interrupt.install(topo)  # SIGINT/SIGTERM stop the training loop at one agreed step on every rank
    if topo.world_size > 1:
        atexit.register(_at_exit, topo)
    if topo.debug:
        install(topo)


def detach(topo: Topology, how: str = "meshwise.shutdown()", failure: str | None = None) -> None:
    """Leave an exit record for ranks that wait on this one, stop the watchdog, unwrap (a shutdown hook).

    The rank's crash report (:mod:`meshwise.debug.crash`) is deleted, or kept with ``failure`` (a traceback).
    """
    atexit.unregister(_at_exit)
    uninstall()
    interrupt.uninstall()
    stop(topo, how, failure)


def _at_exit(topo: Topology) -> None:
    # A script that ends without meshwise.shutdown() still tells the ranks waiting on it that it has left; one
    # that ends on an uncaught exception (Python sets sys.last_value before atexit) keeps its crash report.
    exc = getattr(sys, "last_value", None)
    failure = None if exc is None else "".join(traceback.format_exception(exc))
    detach(topo, "the process exited without meshwise.shutdown()", failure)
