"""A small conv net for 2-D or 3-D fields that runs on one process or on tiles sharded over one or more split dims.

On tiles, each conv first takes ``halo`` cells from the neighbouring tiles (``meshwise.parallel.halo_exchange``)
and runs with no padding along the sharded axes, so each output tile equals the matching tile of the same net
run on the full field with ``padding=halo`` and zeros padding. The net states the parts it needs
(``input_parts``), so ``mesh_dataloader(dataset, topo, parts=model)`` loads exactly those tiles and halos.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshwise.data import Shard
from meshwise.errors import ParallelError
from meshwise.parallel.halo import halo_exchange, pad_loaded_halo

__all__ = ["HeatNet", "HeatNetConfig"]


@dataclass
class HeatNetConfig:
    in_channels: int = 2  # initial temperature and diffusivity
    out_channels: int = 1  # temperature after k steps
    width: int = 16
    depth: int = 4  # conv layers
    halo: int = 1  # kernel = 2 * halo + 1
    spatial: int = 2  # 2: [B, C, H, W] fields (Conv2d); 3: [B, C, D, H, W] volumes (Conv3d)


class HeatNet(nn.Module):
    """``depth`` conv layers of kernel ``2*halo+1`` with GELU between them, predicting a residual update."""

    def __init__(self, config: HeatNetConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or HeatNetConfig()
        if config.spatial not in (2, 3):
            raise ParallelError(f"HeatNet runs on 2-D or 3-D fields, got spatial={config.spatial}")
        conv = nn.Conv2d if config.spatial == 2 else nn.Conv3d
        k = 2 * config.halo + 1
        chans = [config.in_channels] + [config.width] * (config.depth - 1) + [config.out_channels]
        self.convs = nn.ModuleList(conv(a, b, k, padding=0) for a, b in zip(chans, chans[1:]))
        # Off by default: the net runs on the full field until shard() says over which dims and axes.
        self.topology = None
        self.dims: tuple[str, ...] = ()
        self.axes: tuple[int, ...] = ()
        self.input_halo = 0

    def shard(
        self, topology, dim: str | tuple[str, ...] = "domain", axis: int | tuple[int, ...] = -1, input_halo: int = 0
    ) -> HeatNet:
        """Run on tiles sharded over ``dim`` along ``axis`` (negative spatial axes: -1 width, -2 height, -3 depth).

        Several split dims shard several axes: ``dim=("x", "y"), axis=(-2, -1)``. ``input_halo`` is the halo the
        loader reads around each input tile (``Shard(axis, halo=...)``): 0, or ``config.halo`` to let the first
        conv use those cells instead of an exchange.
        """
        dims = (dim,) if isinstance(dim, str) else tuple(dim)
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        spatial = self.config.spatial
        if len(dims) != len(axes) or any(a not in range(-spatial, 0) for a in axes) or len(set(axes)) != len(axes):
            raise ParallelError(
                f"HeatNet shards distinct spatial axes in {list(range(-spatial, 0))}, one per dim: got dim={dim!r}, "
                f"axis={axis!r}"
            )
        if input_halo not in (0, self.config.halo):
            raise ParallelError(
                f"input_halo={input_halo}: the first conv needs {self.config.halo} halo cells; load the input with "
                f"Shard(axis, halo={self.config.halo}) or halo=0"
            )
        self.topology, self.dims, self.axes, self.input_halo = topology, dims, axes, input_halo
        return self

    @property
    def input_parts(self) -> dict[str, list[Shard]]:
        """What the loader must read for this net: each sharded axis over its dim, the input with the loaded halo.

        The target carries no halo: the loss is computed on the cells the rank owns.
        """
        if self.topology is None:
            return {}
        return {
            "input": [Shard(a, halo=self.input_halo, dim=d) for d, a in zip(self.dims, self.axes)],
            "target": [Shard(a, dim=d) for d, a in zip(self.dims, self.axes)],
        }

    def _pad(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        h, spatial = self.config.halo, self.config.spatial
        # Zeros along the axes that are not sharded (F.pad lists the last axis first).
        pad = [0 if -1 - i in self.axes else h for i in range(spatial) for _ in (0, 1)]
        x = F.pad(x, pad)
        if self.topology is None:
            return x
        if layer == 0 and self.input_halo:
            return pad_loaded_halo(x, self.topology, self.dims, self.axes, h)
        return halo_exchange(x, self.topology, self.dims, self.axes, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.config.halo
        u0 = x[:, :1]
        if self.topology is not None and self.input_halo:
            # The residual is added on the tile this rank owns: drop the loaded halo cells.
            for dim, axis in zip(self.dims, self.axes):
                i, k = self.topology.coordinate(dim), self.topology.size(dim)
                n = x.shape[axis]
                lo, hi = (0 if i == 0 else h), (n if i == k - 1 else n - h)
                u0 = u0.narrow(axis, lo, hi - lo)
        for layer, conv in enumerate(self.convs):
            x = conv(self._pad(x, layer))
            if layer < len(self.convs) - 1:
                x = F.gelu(x)
        return u0 + x
