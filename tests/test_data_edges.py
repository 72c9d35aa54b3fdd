"""Parts from the model and from DTensor placements, and the data edge cases: zero-cell tiles, the largest halo,
missing paths, Zarr/HDF5 groups, chunkings that defeat partial reads, errors that list the mesh's dims (one process).
"""

from __future__ import annotations

import warnings

import h5py
import numpy as np
import pytest
import torch
import zarr
from test_data_sampler import layout_topology
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard

from meshwise.data import ArrayDataset, Replicate, Shard, mesh_dataloader
from meshwise.data.parts import from_placements, largest_halo, parts_of
from meshwise.errors import DataError

FIELD = np.arange(4 * 2 * 6 * 9, dtype=np.float32).reshape(4, 2, 6, 9)


class Net(torch.nn.Module):
    """A model that states its parts, as a user's domain-parallel model would."""

    def __init__(self, parts):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.input_parts = parts


class Wrapper(torch.nn.Module):  # DDP keeps the user's model in .module
    def __init__(self, module):
        super().__init__()
        self.module = module


def _loader(topo, parts, field=FIELD, **kw):
    return mesh_dataloader(
        {"input": field, "target": field[:, :1]}, topo, global_batch_size=4, mode="eval", parts=parts, **kw
    )


def test_parts_from_the_model_equal_the_written_parts():
    roles = {"x": "split", "y": "split"}
    written = {
        "input": [Shard(1, halo=1, dim="x"), Shard(2, halo=2, dim="y")],
        "target": [Shard(1, dim="x"), Shard(2, dim="y")],
    }
    for rank in range(4):
        topo = layout_topology({"dp": 1, "x": 2, "y": 2}, rank, roles)
        want = _loader(topo, written)
        for parts in (Net(written), Wrapper(Net(written)), Net(lambda: written)):
            got = _loader(topo, parts)
            assert got.parts == want.parts
            (a,), (b,) = list(got), list(want)
            assert all(torch.equal(a[k], b[k]) for k in b)
        # DTensor placements over the (dp, x, y) mesh: batch axis 0 over dp, tensor axes 2 and 3 over x and y
        placed = {
            "input": (("dp", "x", "y"), [DShard(0), DShard(2), DShard(3)], {"x": 1, "y": 2}),
            "target": (("dp", "x", "y"), [DShard(0), DShard(2), DShard(3)]),
        }
        assert _loader(topo, placed).parts == want.parts
        assert _loader(topo, Net(placed)).parts == want.parts
    topo = layout_topology({"dp": 1, "x": 2, "y": 2}, 3, roles)
    assert from_placements(("x", "y"), [DReplicate(), DReplicate()], topo) == Replicate()
    assert from_placements(("y",), [DShard(-1)], topo, halo=1) == [Shard(-1, halo=1, dim="y")]


def test_model_and_placement_errors_name_the_dims_and_the_fix():
    pn = layout_topology({"data_parallel": 2, "model_parallel": 2}, 0, {"model_parallel": "replica"})
    text = "data_parallel=2 (batch), model_parallel=2 (replica)"
    with pytest.raises(DataError, match=r"role 'replica'.*roles=\{'model_parallel': 'split'\}") as e:
        from_placements(("data_parallel", "model_parallel"), [DShard(0), DShard(3)], pn)
    assert text in str(e.value)
    with pytest.raises(DataError, match="no 'split' dim") as e:
        _loader(pn, {"input": Shard(2)})
    assert text in str(e.value)
    with pytest.raises(DataError, match=r"only\s+Shard\(0\) fits"):
        from_placements(("data_parallel",), [DShard(1)], pn)
    with pytest.raises(DataError, match="no dim 'domain'"):
        from_placements(("domain",), [DShard(1)], pn)
    with pytest.raises(DataError, match="one\\s+placement per named mesh dim"):
        from_placements(("data_parallel", "model_parallel"), [DShard(0)], pn)
    split = layout_topology({"data_parallel": 2, "model_parallel": 2}, 0, {"model_parallel": "split"})
    assert from_placements(("data_parallel", "model_parallel"), [DShard(0), DShard(3)], split) == [
        Shard(2, dim="model_parallel")
    ]
    with pytest.raises(DataError, match="axis 0 is the batch"):
        from_placements(("model_parallel",), [DShard(0)], split)
    with pytest.raises(DataError, match="Partial"):
        from_placements(("model_parallel",), [Partial()], split)
    with pytest.raises(DataError, match="not a split dim of the mesh \\(data_parallel=2 \\(batch\\)"):
        _loader(split, {"input": Shard(1, dim="data_parallel")})
    with pytest.raises(DataError, match="states no input_parts"):
        parts_of(torch.nn.Linear(2, 2), split)


def test_zero_cell_tiles_are_refused_at_loader_creation():
    for rank in range(4):  # every rank raises the same error, not only the one with the empty tile
        topo = layout_topology({"cp": 4}, rank)
        with pytest.raises(DataError, match=r"tiles of \[1, 1, 1, 0\] cells.*at most 3 'cp' ranks"):
            _loader(topo, {"input": Shard(0)}, field=np.zeros((4, 3, 8), np.float32))
        # 5 cells over 4 ranks: torch.chunk gives 2, 2, 1, 0
        with pytest.raises(DataError, match=r"\[2, 2, 1, 0\].*zero cells"):
            _loader(topo, {"input": Shard(1)}, field=np.zeros((4, 3, 5), np.float32))


def test_largest_halo_is_the_smallest_tile():
    # 9 cells over 2: tiles of 5 and 4; halo_exchange allows halo <= 4 (tests/test_domain.py checks the same)
    assert largest_halo(9, 2) == 4
    for rank in range(2):
        topo = layout_topology({"cp": 2}, rank)
        ld = _loader(topo, {"input": Shard(2, halo=4)})
        (batch,) = list(ld)
        assert torch.equal(batch["input"], torch.from_numpy(FIELD[(slice(None), *ld.parts["input"].region)]))
        with pytest.raises(DataError, match=r"halo 5 > the smallest tile.*largest halo is 4 \(as for halo_exchange\)"):
            _loader(topo, {"input": Shard(2, halo=5)})


def test_paths_and_groups(tmp_path):
    with pytest.raises(DataError, match=r"'input': the path .*nope\.npy' does not exist"):
        ArrayDataset({"input": str(tmp_path / "nope.npy")})
    with pytest.raises(DataError, match="does not exist"):
        ArrayDataset({"input": tmp_path / "nope.zarr"})
    with pytest.raises(DataError, match="relative to the working directory"):
        ArrayDataset({"input": "surely/not/here.npy"})
    root = zarr.open_group(str(tmp_path / "heat.zarr"), mode="w")
    root.create_array("input", shape=(4, 3), dtype="float32")
    root.create_array("target", shape=(4, 3), dtype="float32")
    for value in (root, str(tmp_path / "heat.zarr"), zarr.open(str(tmp_path / "heat.zarr"), mode="r")):
        with pytest.raises(DataError, match=r"is a Zarr group \(arrays: \['input', 'target'\]\), not an array: pass"):
            ArrayDataset({"x": value})
    assert ArrayDataset({"x": str(tmp_path / "heat.zarr" / "input")}).sources["x"].shape == (4, 3)
    with h5py.File(tmp_path / "f.h5", "w") as f:
        f.create_group("fields").create_dataset("u", data=np.zeros((4, 3)))
    with h5py.File(tmp_path / "f.h5", "r") as f:
        with pytest.raises(DataError, match=r"HDF5 '/fields' is a group \(members: \['u'\]\).*group\['u'\]"):
            ArrayDataset({"x": f["fields"]})
    with pytest.raises(DataError, match="HDF5 file"):
        ArrayDataset({"x": str(tmp_path / "f.h5")})


def test_chunkings_that_defeat_partial_reads_warn_once_per_field(tmp_path):
    data = np.random.default_rng(0).standard_normal((4, 2, 16, 16)).astype(np.float32)
    whole = zarr.create_array(str(tmp_path / "whole.zarr"), shape=data.shape, chunks=(1, 2, 16, 16), dtype="float32")
    whole[...] = data
    good = zarr.create_array(str(tmp_path / "good.zarr"), shape=data.shape, chunks=(1, 2, 16, 4), dtype="float32")
    good[...] = data
    with h5py.File(tmp_path / "c.h5", "w") as f:
        f.create_dataset("wide", data=data, chunks=(1, 2, 16, 12))
    h5 = h5py.File(tmp_path / "c.h5", "r")
    topo = layout_topology({"cp": 4}, 1)  # tiles of 4 columns
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ld = mesh_dataloader(
            {"a": whole, "b": h5["wide"], "c": good, "d": whole},
            topo,
            global_batch_size=4,
            mode="eval",
            parts={"a": Shard(2), "b": Shard(2, halo=1), "c": Shard(2, halo=1)},  # d: replicated, reads whole
        )
    messages = sorted(str(w.message) for w in caught if issubclass(w.category, UserWarning))
    assert len(messages) == 2, messages  # a and b; c's chunks fit its tiles, d is not sharded
    assert "'a': its zarr chunks (1, 2, 16, 16)" in messages[0] and "reads 4.00x the bytes" in messages[0]
    assert "chunks=(1, 2, 16, 4)" in messages[0]
    # b: the tile [4, 8) plus a halo column each side, [3, 9), lies in the first 12-wide chunk: 12 of 6 columns
    assert "'b': its hdf5 chunks (1, 2, 16, 12)" in messages[1] and "reads 2.00x" in messages[1]
    (batch,) = list(ld)
    nb = data[0].nbytes  # a and d: whole samples; b: 12 of 16 columns; c: the 4-wide chunks of [3, 9), 12 columns
    assert ld.bytes_read == 4 * (nb + nb * 12 // 16 + nb * 12 // 16 + nb)
    assert torch.equal(batch["a"], torch.from_numpy(data[..., 4:8]))
    h5.close()
