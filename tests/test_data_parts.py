"""Sample parts from every source (npy, Zarr, HDF5, tensor, numpy) at split sizes 2 and 4: halos, reassembly, bytes."""

from __future__ import annotations

import warnings

import h5py
import numpy as np
import pytest
import torch
import zarr
from test_data_sampler import layout_topology

from meshwise.data import ArrayDataset, Replicate, Shard, chunk_bounds, mesh_dataloader
from meshwise.data.parts import resolve_part
from meshwise.errors import DataError, DataWarning

N, SHAPE = 9, (2, 14, 10)  # samples of 2 x 14 x 10: axis 1 splits unevenly in 4 (4, 4, 4, 2)


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    field = rng.standard_normal((N, *SHAPE)).astype(np.float32)
    label = np.arange(N, dtype=np.int64) * 10
    np.save(root / "field.npy", field)
    z = zarr.create_array(str(root / "field.zarr"), shape=field.shape, chunks=(1, 2, 2, 10), dtype="float32")
    z[...] = field
    with h5py.File(root / "field.h5", "w") as f:
        f.create_dataset("field", data=field)
        f.create_dataset("chunked", data=field, chunks=(1, 2, 7, 5))
    return root, field, label


def sources(root, field):
    h5 = h5py.File(root / "field.h5", "r")
    return {
        "npy": str(root / "field.npy"),
        "zarr": zarr.open_array(str(root / "field.zarr"), mode="r"),
        "zarr-path": str(root / "field.zarr"),
        "hdf5": h5["field"],
        "hdf5-chunked": h5["chunked"],
        "tensor": torch.from_numpy(field.copy()),
        "numpy": field,
    }


@pytest.mark.parametrize("k,halo", [(2, 3), (4, 1)])
def test_parts_reassemble_and_halos_match_neighbours(arrays, k, halo):
    root, field, label = arrays
    for kind, src in sources(root, field).items():
        per_rank = []
        for rank in range(2 * k):  # dp=2 x cp=k: each data rank's split ranks share samples, not cells
            topo = layout_topology({"dp": 2, "cp": k}, rank)
            ds = ArrayDataset({"input": src, "label": label})
            parts = {"input": Shard(1, halo=halo), "label": Replicate()}
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", DataWarning)
                ld = mesh_dataloader(ds, topo, global_batch_size=4, mode="eval", parts=parts)
            # exactly one warning, for the one store whose chunks (7 cells) are wider than a tile (4 cells, at k=4)
            wide = kind == "hdf5-chunked" and k == 4
            said = [str(w.message) for w in caught if w.category is DataWarning]
            assert len(said) == wide and all("wider than a tile along sample axis 1" in m for m in said), kind
            batches = list(ld)
            per_rank.append((topo.data_rank, topo.coordinate("cp"), ld.parts["input"], batches, ld.bytes_read))
        for data_rank in range(2):
            group = sorted((r for r in per_rank if r[0] == data_rank), key=lambda r: r[1])
            for step in range(len(group[0][3])):
                idx = group[0][3][step]["index"]
                valid = idx >= 0
                assert all(torch.equal(g[3][step]["index"], idx) for g in group), "split ranks share indices"
                truth = torch.from_numpy(field[idx[valid].numpy()])
                interiors = [g[2].strip_halo(g[3][step]["input"])[valid] for g in group]
                assert torch.equal(torch.cat(interiors, dim=2), truth), f"{kind}: parts put back together"
                for cp, (_, _, part, batches, _) in enumerate(group):
                    loaded = batches[step]["input"][valid]
                    assert torch.equal(loaded, truth[(slice(None), *part.region)]), f"{kind}: halo = neighbours' cells"
                    start, stop = chunk_bounds(SHAPE[1], k, cp)
                    assert part.region[1] == slice(max(0, start - halo), min(SHAPE[1], stop + halo))
                    assert torch.equal(batches[step]["label"][valid], torch.from_numpy(label[idx[valid].numpy()]))
                    assert torch.all(batches[step]["input"][~valid] == 0)
        # bytes: this rank's part only (whole chunks for chunked stores)
        for _, _, part, batches, nbytes in per_rank:
            rows = sum(int(b["valid"].sum()) for b in batches)
            region_bytes = rows * int(np.prod(part.shape)) * 4 + rows * 8
            r = part.region[1]
            if kind in ("zarr", "zarr-path"):  # chunks of 2 rows along axis 1: whole chunks are counted
                rows_read = min(2 * -(-r.stop // 2), SHAPE[1]) - 2 * (r.start // 2)
                assert nbytes == rows * (2 * rows_read * 10 * 4 + 8), kind
            elif kind == "hdf5-chunked":  # chunks of 7 rows
                rows_read = min(7 * -(-r.stop // 7), SHAPE[1]) - 7 * (r.start // 7)
                assert nbytes == rows * (2 * rows_read * 10 * 4 + 8), kind
            else:
                assert nbytes == region_bytes, kind
                assert nbytes < rows * (field[0].nbytes + 8)


def test_border_policy_and_two_split_dims():
    split = {"cp": (0, 4)}
    first = resolve_part("x", Shard(0, halo=2), (16,), split)
    assert first.region == (slice(0, 6),) and first.interior == (slice(0, 4),)  # no halo beyond the border
    mid = resolve_part("x", Shard(0, halo=2), (16,), {"cp": (1, 4)})
    assert mid.region == (slice(2, 10),) and mid.interior == (slice(2, 6),)
    last = resolve_part("x", Shard(-1, halo=2), (16,), {"cp": (3, 4)})
    assert last.region == (slice(10, 16),) and last.interior == (slice(2, 6),)
    two = {"sx": (1, 2), "sy": (2, 3)}
    p = resolve_part("x", [Shard(0, dim="sx"), Shard(1, halo=1, dim="sy")], (4, 9), two)
    assert p.region == (slice(2, 4), slice(5, 9)) and p.interior == (slice(0, 2), slice(1, 4))
    assert dict(p.placements) == {"sx": 0, "sy": 1}


def test_bad_parts():
    with pytest.raises(DataError, match=r"halo 3 > the smallest tile \(2 of 14"):
        resolve_part("x", Shard(1, halo=3), SHAPE, {"cp": (0, 4)})
    with pytest.raises(DataError, match="axis 3 is out of range"):
        resolve_part("x", Shard(3), SHAPE, {"cp": (0, 2)})
    with pytest.raises(DataError, match="no 'split' dim"):
        resolve_part("x", Shard(0), SHAPE, {})
    with pytest.raises(DataError, match="several split dims"):
        resolve_part("x", Shard(0), SHAPE, {"a": (0, 2), "b": (0, 2)})
    with pytest.raises(DataError, match="halo must be an int >= 0"):
        Shard(0, halo=-1)
    ds = ArrayDataset({"input": np.zeros((4, *SHAPE), np.float32)})
    with pytest.raises(DataError, match="no 'split' dim"):
        mesh_dataloader(ds, layout_topology({"dp": 2}, 0), global_batch_size=2, parts={"input": Shard(0)})
    with pytest.raises(DataError, match="lacks"):
        mesh_dataloader(ds, layout_topology({"dp": 2}, 0), global_batch_size=2, parts={"output": Shard(0)})


def test_two_split_dims_through_the_loader_and_torch_only_dtypes():
    field = torch.arange(5 * 6 * 7, dtype=torch.float32).reshape(5, 6, 7).to(torch.bfloat16)
    mesh, roles = {"sx": 2, "sy": 2}, {"sx": "split", "sy": "split"}
    tiles = {}
    for rank in range(4):
        topo = layout_topology(mesh, rank, roles)
        ld = mesh_dataloader(
            {"input": field},
            topo,
            global_batch_size=5,
            mode="eval",
            parts={"input": [Shard(0, dim="sx"), Shard(1, halo=1, dim="sy")]},
        )
        (batch,) = list(ld)
        assert batch["input"].dtype == torch.bfloat16
        part = ld.parts["input"]
        assert torch.equal(batch["input"], field[(slice(None), *part.region)])
        tiles[(topo.coordinate("sx"), topo.coordinate("sy"))] = part.strip_halo(batch["input"])
    rows = [torch.cat([tiles[(x, y)] for y in range(2)], dim=2) for x in range(2)]
    assert torch.equal(torch.cat(rows, dim=1), field)
