"""What every GPU check script shares: the device from the environment, meshes that fit the world, the result line.

Each check is a plain script, started the way a user starts one (``python check_x.py`` for one process,
``meshwise run --nproc-per-node N check_x.py`` for more). ``MESHWISE_CHECK_DEVICE`` picks the device: ``cuda``
(the default: NCCL, ``cuda:LOCAL_RANK``) or ``cpu`` (gloo), so that the logic of every check can be run and
debugged on a machine without a GPU. A check that fails raises (the process exits non-zero); a check that
passes prints one ``MESHWISE_CHECK {json}`` line per rank with what it measured.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch

import meshwise

KINDS = ("cuda", "cpu")


def device_kind() -> str:
    """``cuda`` or ``cpu``, from ``MESHWISE_CHECK_DEVICE`` (default ``cuda``); CUDA asked for but absent stops here."""
    kind = os.environ.get("MESHWISE_CHECK_DEVICE", "cuda").strip().lower()
    if kind not in KINDS:
        raise SystemExit(f"MESHWISE_CHECK_DEVICE={kind!r}: use one of {KINDS}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"no CUDA device (torch {torch.__version__}): run on a GPU with a CUDA build of torch, or set "
            "MESHWISE_CHECK_DEVICE=cpu to run this check's logic on CPU/gloo"
        )
    return kind


def world_size() -> int:
    """The launch's world size (``WORLD_SIZE``, 1 for a plain ``python`` start)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def two_if(divides: int) -> int:
    """2 where the world size divides by ``divides`` (so a dim of 2 fits beside the others), else 1."""
    return 2 if world_size() % divides == 0 else 1


def init(mesh: Mapping[str, int], **kwargs: Any) -> meshwise.Topology:
    """``meshwise.init`` on the check's device: NCCL on CUDA (the backend init picks there), gloo on CPU.

    On CUDA this also checks what ``init`` promises: the topology's device is ``cuda:LOCAL_RANK`` and is the
    current device, and the backend is NCCL.
    """
    kind = device_kind()
    topo = meshwise.init(dict(mesh), backend=None if kind == "cuda" else "gloo", timeout=120, **kwargs)
    if kind == "cuda":
        expected = torch.device("cuda", topo.local_rank % torch.cuda.device_count())
        assert topo.device == expected, f"{topo.label()}: device {topo.device}, expected {expected}"
        assert torch.cuda.current_device() == expected.index, (torch.cuda.current_device(), expected)
        assert topo.backend == "nccl", topo.backend
    else:
        assert topo.device == torch.device("cpu") and topo.backend == "gloo", (topo.device, topo.backend)
    return topo


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a plain tensor as it is), detached."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def max_param_diff(model: torch.nn.Module, reference: Mapping[str, torch.Tensor], subset: bool = False) -> float:
    """The largest absolute difference between ``model``'s full parameters and ``reference`` (by name).

    The names must be the reference's, or (``subset``: a pipeline stage) some of them."""
    worst = 0.0
    names = set()
    for name, p in model.named_parameters():
        names.add(name)
        worst = max(worst, (full(p).to(reference[name]) - reference[name]).abs().max().item())
    if subset:
        assert names and names <= set(reference), f"parameters not in the reference: {sorted(names - set(reference))}"
    else:
        assert names == set(reference), f"parameter names differ: {sorted(names ^ set(reference))}"
    return worst


def report(check: str, topo: meshwise.Topology, **values: Any) -> None:
    """Print this rank's result line; the check passed when every rank printed one."""
    line = {
        "check": check,
        "rank": topo.rank,
        "world_size": topo.world_size,
        "mesh": topo.sizes,
        "device": str(topo.device),
        "backend": topo.backend,
        "torch": torch.__version__,
        **values,
    }
    print("MESHWISE_CHECK " + json.dumps(line, sort_keys=True), flush=True)
    sys.stdout.flush()
