"""meshwise's shard writer writes the bytes DCP's own writer writes (with the CRC off), DCP's public load reads them,
and the process-wide CRC option is restored afterwards. One process, no launch."""

from __future__ import annotations

import zipfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.futures import Future

from meshwise.checkpoint.writer import without_crc32, write_shard


class _Framed(FileSystemWriter):
    def write_data(self, plan, planner):
        fut = Future()
        fut.set_result(write_shard(self, plan, planner))
        return fut


class _Dcp(FileSystemWriter):  # DCP's own writer, with the CRC off as meshwise writes
    def write_data(self, plan, planner):
        with without_crc32():
            return super().write_data(plan, planner)


def test_shard_file_is_dcp_bytes(tmp_path):
    torch.manual_seed(0)
    state = {
        "f32": torch.randn(64, 32),
        "f64": torch.randn(2, 3, dtype=torch.float64),
        "bf16": torch.randn(7).bfloat16(),
        "i8": torch.randint(-5, 5, (9,), dtype=torch.int8),
        "i64": torch.arange(5),
        "bool": torch.tensor(True),
        "zero_d": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(8, 4).t(),
        "sliced": torch.randn(10, 10)[2:5],
        "expanded": torch.randn(4, 4).expand(2, 4, 4),
        "offset": torch.arange(4.0).as_strided((2, 2), (0, 1), 2),
        "complex": torch.randn(3, dtype=torch.cfloat),
        "param": torch.nn.Parameter(torch.randn(3, 3)),
        "n": 3,
        "lr": 1e-3,
        "names": [1, "x"],
    }
    for name, writer in (("framed", _Framed), ("dcp", _Dcp)):
        dcp.save(state, storage_writer=writer(str(tmp_path / name), sync_files=False), no_dist=True)
    assert (tmp_path / "framed" / "__0_0.distcp").read_bytes() == (tmp_path / "dcp" / "__0_0.distcp").read_bytes()
    metas = [FileSystemReader(str(tmp_path / n)).read_metadata().storage_data for n in ("framed", "dcp")]
    assert metas[0] == metas[1]
    back = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    dcp.load(back, checkpoint_id=str(tmp_path / "framed"), no_dist=True)  # DCP's public load reads it
    assert all(torch.equal(back[k], state[k].detach()) for k in back)
    # the process-wide CRC option is back: a user's torch.save afterwards is a zip with valid CRCs
    assert torch.serialization.get_crc32_options()
    torch.save(state["f32"], tmp_path / "user.pt")
    assert zipfile.ZipFile(tmp_path / "user.pt").testzip() is None
