"""Debug mode: wrap ``torch.distributed``'s collectives and compare each call's fingerprint through the store.

With ``meshwise.init(..., debug=True)`` or ``MESHWISE_DEBUG=1``, a collective on a topology group first
exchanges a fingerprint (dims, role, op, shapes, dtype, step, call site) with its group through the
rendezvous store. A difference raises :class:`CollectiveMismatchError` on every rank of the group *before*
the collective runs (no gloo abort, the group stays usable); a rank that never comes is a
:class:`CollectiveTimeoutError` naming it. With debug off nothing is wrapped and no fingerprint is exchanged.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from meshwise.debug.watchdog import (
    compare,
    guarded,
    innermost,
)
from meshwise.topology import Topology, current

__all__ = ["COLLECTIVE_OPS", "compare", "install", "uninstall"]

# Every torch.distributed collective debug mode wraps, with the arguments that go into its fingerprint:
# (tensors whose shape and dtype must agree, attributes that must agree). Shapes of all_to_all may differ by
# design: dtype only. Read-only: tests count exactly these ops.
COLLECTIVE_OPS: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = MappingProxyType(
    {
        "all_reduce": (("tensor",), ("op",)),
        "reduce": (("tensor",), ("op", "dst", "group_dst")),
        "broadcast": (("tensor",), ("src", "group_src")),
        "all_gather": (("tensor",), ()),
        "all_gather_into_tensor": (("input_tensor", "output_tensor"), ()),
        "all_gather_single": (("input_tensor", "output_tensor"), ()),  # what FSDP2 calls on torch 2.13
        "all_reduce_coalesced": (("tensors",), ("op",)),
        "all_gather_coalesced": (("input_tensor_list",), ()),
        "reduce_scatter": (("output",), ("op",)),
        "reduce_scatter_tensor": (("input", "output"), ("op",)),
        "reduce_scatter_single": (("input", "output"), ("op",)),
        "all_to_all_single": ((), ()),
        "all_to_all": ((), ()),
        "gather": (("tensor",), ("dst", "group_dst")),
        "scatter": (("tensor",), ("src", "group_src")),
        "barrier": ((), ()),
        "all_gather_object": ((), ()),
        "broadcast_object_list": ((), ("src", "group_src")),
        "gather_object": ((), ("dst", "group_dst")),
        "scatter_object_list": ((), ("src", "group_src")),
    }
)
_ORIGINAL: dict[str, Callable[..., Any]] = {}
_INSIDE = threading.local()  # a wrapped collective called by another one is part of it: not checked again


def install(topo: Topology) -> None:
    """Wrap ``torch.distributed``'s collectives so calls on the topology's groups are fingerprinted first."""
    groups = {topo.group(dims).group_name: dims for dims in topo.group_dims}
    groups[dist.group.WORLD.group_name] = topo.dims
    for name in COLLECTIVE_OPS:
        if hasattr(dist, name):  # some exist only in newer torch releases
            real = _ORIGINAL.setdefault(name, getattr(dist, name))
            setattr(dist, name, _checked(topo, groups, name, real))


def _checked(
    topo: Topology, groups: dict[str, tuple[str, ...]], name: str, real: Callable[..., Any]
) -> Callable[..., Any]:
    signature = inspect.signature(real)
    tensor_args, attr_args = COLLECTIVE_OPS[name]

    @functools.wraps(real)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if getattr(_INSIDE, "on", False) or current() is not topo:  # nested, or a wrapper left by a finished run
            return real(*args, **kwargs)
        try:
            call = signature.bind(*args, **kwargs)
        except TypeError:
            return real(*args, **kwargs)  # torch reports its own argument errors
        call.apply_defaults()  # an explicit op=SUM and the default one are the same call
        bound = call.arguments
        dims = groups.get(getattr(bound.get("group") or dist.group.WORLD, "group_name", None))
        top = innermost()
        if dims is None or (
            top is not None and not top.region and top.dims == dims and top.thread == threading.get_ident()
        ):
            return real(*args, **kwargs)  # not a topology group, or already checked by meshwise's own guard
        attrs = [f"{a}={_attr(bound[a])}" for a in attr_args if bound.get(a) is not None]
        op = name + (f"({', '.join(attrs)})" if attrs else "")
        tensors = [t for a in tensor_args for t in _tensors(bound.get(a))]
        if name.startswith("all_to_all"):
            first = bound.get("input", bound.get("input_tensor_list"))
            first = first[0] if isinstance(first, (list, tuple)) and first else first
            op += f" {str(getattr(first, 'dtype', '')).removeprefix('torch.')}"
        with guarded(topo, dims, op, tensor=tensors or None, check=True):
            _INSIDE.on = True
            try:
                return real(*args, **kwargs)
            finally:
                _INSIDE.on = False

    return checked


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _attr(value: Any) -> str:
    return str(getattr(value, "name", value))


def uninstall() -> None:
    """Put torch's own collectives back (called by ``meshwise.shutdown``); a no-op when nothing is wrapped."""
    for name, real in _ORIGINAL.items():
        if getattr(getattr(dist, name), "__wrapped__", None) is real:  # leave anyone else's wrapper alone
            setattr(dist, name, real)
    _ORIGINAL.clear()
