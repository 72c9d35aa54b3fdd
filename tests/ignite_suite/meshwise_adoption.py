"""A pytest plugin that runs ignite's own test-suite with meshwise's adoption of ignite metrics active.

Every ignite ``Engine.run`` first calls ``meshwise.metrics.adopt_ignite_metrics`` on a topology of the run's
process group: ``{"dp": 1}`` in one process, or the process group ignite's distributed fixtures made, adopted as
a plain data-parallel mesh (``dp`` = its world size). The topology is shut down after each test, before ignite's
fixtures tear their process group down. With ``MESHWISE_IGNITE_REPORT`` set, each process appends to that file
how many engine runs it adopted and on which meshes. Used by ``make test-ignite-metrics`` (docs/ignite.md).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import torch.distributed as dist
from ignite.engine import Engine

import meshwise
from meshwise.metrics import adopt_ignite_metrics

_RUN = Engine.run
_TOPOLOGY: list[Any] = []
_ADOPTED: Counter[str] = Counter()  # engine runs adopted, by mesh


def _topology() -> Any:
    if not _TOPOLOGY:
        if dist.is_initialized() and dist.get_world_size() > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
            _TOPOLOGY.append(meshwise.init(mesh))
        else:
            _TOPOLOGY.append(meshwise.init({"dp": 1}, backend="gloo"))
    return _TOPOLOGY[0]


def _run(self: Engine, *args: Any, **kwargs: Any) -> Any:
    topo = _topology()
    adopt_ignite_metrics(self, topo)
    _ADOPTED[topo.layout.dims_text()] += 1
    return _RUN(self, *args, **kwargs)


def pytest_configure(config: pytest.Config) -> None:
    Engine.run = _run  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _meshwise_topology() -> Any:
    yield
    if _TOPOLOGY:
        _TOPOLOGY.clear()
        meshwise.shutdown()


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("MESHWISE_IGNITE_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(f"pid {os.getpid()}: adopted engine runs by mesh {dict(_ADOPTED)}\n")
