"""A small conv net for 2-D fields that runs on one process or on tiles of the field sharded over a ``split`` dim.

On tiles, each conv first takes ``halo`` cells from the neighbouring tiles (``meshwise.parallel.halo_exchange``)
and runs with no padding along the sharded axis, so each output tile equals the matching tile of the same net
run on the full field with ``padding=halo`` and zeros padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshwise.errors import ParallelError
from meshwise.parallel.halo import halo_exchange, pad_loaded_halo


@dataclass
class HeatNetConfig:
    in_channels: int = 2  # initial temperature and diffusivity
    out_channels: int = 1  # temperature after k steps
    width: int = 16
    depth: int = 4  # conv layers
    halo: int = 1  # kernel = 2 * halo + 1


class HeatNet(nn.Module):
    """``depth`` Conv2d layers of kernel ``2*halo+1`` with GELU between them, predicting a residual update."""

    def __init__(self, config: HeatNetConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or HeatNetConfig()
        k = 2 * config.halo + 1
        chans = [config.in_channels] + [config.width] * (config.depth - 1) + [config.out_channels]
        self.convs = nn.ModuleList(nn.Conv2d(a, b, k, padding=0) for a, b in zip(chans, chans[1:]))
        # Off by default: the net runs on the full field until shard() says over which dim and axis.
        self.topology = None
        self.dim: str | None = None
        self.axis = -1
        self.input_halo = 0

    def shard(self, topology, dim: str = "domain", axis: int = -1, input_halo: int = 0) -> HeatNet:
        """Run on tiles sharded over ``dim`` along ``axis`` (-1 width, -2 height) of a ``[B, C, H, W]`` batch.

        ``input_halo`` is the halo the loader already read around each input tile (``Shard(axis, halo=...)``):
        0, or ``config.halo`` to let the first conv use those cells instead of an exchange.
        """
        if axis not in (-1, -2):
            raise ParallelError(f"HeatNet shards the height (-2) or width (-1) axis, got axis={axis}")
        if input_halo not in (0, self.config.halo):
            raise ParallelError(
                f"input_halo={input_halo}: the first conv needs {self.config.halo} halo cells; load the input with "
                f"Shard(axis, halo={self.config.halo}) or halo=0"
            )
        self.topology, self.dim, self.axis, self.input_halo = topology, dim, axis, input_halo
        return self

    def _pad(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        h = self.config.halo
        # Zeros along the axis that is not sharded (F.pad lists the last axis first).
        other = [0, 0, h, h] if self.axis == -1 else [h, h, 0, 0]
        x = F.pad(x, other)
        if self.topology is None:
            return F.pad(x, [h, h, 0, 0] if self.axis == -1 else [0, 0, h, h])
        if layer == 0 and self.input_halo:
            return pad_loaded_halo(x, self.topology, self.dim, self.axis, h)
        return halo_exchange(x, self.topology, self.dim, self.axis, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.config.halo
        u0 = x[:, :1]
        if self.topology is not None and self.input_halo:
            # The residual is added on the tile this rank owns: drop the loaded halo cells.
            i, k = self.topology.coordinate(self.dim), self.topology.size(self.dim)
            n = x.shape[self.axis]
            lo, hi = (0 if i == 0 else h), (n if i == k - 1 else n - h)
            u0 = u0.narrow(self.axis, lo, hi - lo)
        for layer, conv in enumerate(self.convs):
            x = conv(self._pad(x, layer))
            if layer < len(self.convs) - 1:
                x = F.gelu(x)
        return u0 + x
