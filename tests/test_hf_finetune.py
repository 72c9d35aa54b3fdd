"""examples/hf_finetune/train.py and load_hf into sharded models, in one 4-process launch.

The launch first loads the example's ``save_pretrained`` folder into a Llama built on the meta device, sharded
(tp=4, then dp=2 x tp=2) and materialised with ``to_empty``: logits equal ``from_pretrained``'s in one process
and each rank reads about a quarter of the folder's bytes. Then it runs the example as a user would run it
twice under a launcher: stopped after step 3 at dp=2 x tp=2, resumed at tp=4 to step 6, exported. An unbroken
one-process run of the script is the reference: same losses and final parameters within 1e-12; the exported
folders reload with ``from_pretrained``; an export into a folder holding another model is refused.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch

from meshwise.testing import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "hf_finetune"))
import train as example  # noqa: E402

STEPS, STOP = 6, 3
IDS = torch.arange(24).reshape(2, 12) * 5 % 128


def _sharded_loads(pretrained: str) -> dict:
    """load_hf into a meta-built model sharded at tp=4 and at dp=2 x tp=2: logits and bytes read on this rank."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig, AutoModelForCausalLM

    import meshwise
    from meshwise.checkpoint import load_hf

    out = {}
    for mesh in ("tp=4", "dp=2,tp=2"):
        topo = meshwise.init(mesh)
        with torch.device("meta"):  # shapes only: no rank ever holds the whole model
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(pretrained)).to(torch.float64)
        model = meshwise.parallelize(model, topo, tp_plan="auto", dp="fsdp")
        model.to_empty(device=topo.device)
        read = load_hf(pretrained, model)
        local = sum(
            (t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size()
            for t in model.state_dict().values()
        )
        with torch.no_grad():
            out[mesh] = {"logits": model(input_ids=IDS).logits, "read": read, "local": local}
        meshwise.shutdown()
    return out


def _launch(pretrained: str, run_dir: str) -> dict:
    loads = _sharded_loads(pretrained)
    args = ["--run-dir", run_dir, "--steps", str(STEPS)]
    first = example.main(["--mesh", "dp=2,tp=2", *args, "--stop-at", str(STOP)])
    resumed = example.main(["--mesh", "tp=4", *args])
    return {"loads": loads, "first": first, "resumed": resumed}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf_finetune")
    broken = base / "broken"
    example.write_pretrained(broken / "pretrained", seed=0)  # what the script writes on its first run
    out = run_distributed(_launch, 4, str(broken / "pretrained"), str(broken), timeout=280, pg_timeout=120)
    unbroken = example.main(["--mesh", "dp=1", "--run-dir", str(base / "unbroken"), "--steps", str(STEPS)])
    return base, out, unbroken


def test_load_hf_into_meta_built_sharded_models(runs):
    from transformers import AutoModelForCausalLM

    base, out, _ = runs
    folder = base / "broken" / "pretrained"
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64)
    with torch.no_grad():
        want = reference(input_ids=IDS).logits
    size = (folder / "model.safetensors").stat().st_size
    for mesh in ("tp=4", "dp=2,tp=2"):
        for rank in out:
            got = rank["loads"][mesh]
            assert (got["logits"] - want).abs().max().item() <= 1e-12, mesh
            # bytes read: this rank's shards (replicated norms whole) plus the file's header, nothing else
            header = size - sum(t.numel() * t.element_size() for t in reference.state_dict().values())
            assert got["read"] == got["local"] + header, (mesh, got["read"], got["local"], header)
            assert got["read"] / size <= 0.27, (mesh, got["read"] / size)
    print("bytes read per rank / folder:", {m: out[0]["loads"][m]["read"] / size for m in out[0]["loads"]})


def test_stopped_and_resumed_on_another_mesh_equals_one_process(runs):
    base, out, unbroken = runs
    first, resumed = out[0]["first"], out[0]["resumed"]
    assert len(first["losses"]) == STOP and len(resumed["losses"]) == STEPS - STOP
    assert first["exported"] is None and resumed["exported"] is not None
    losses = first["losses"] + resumed["losses"]
    assert max(abs(a - b) for a, b in zip(losses, unbroken["losses"], strict=True)) <= 1e-12, losses
    assert unbroken["losses"][-1] < unbroken["losses"][0]  # it learns
    # the final parameters, as exported: the broken run's equal the unbroken one-process run's
    got, want = _tensors(base / "broken" / "finetuned"), _tensors(base / "unbroken" / "finetuned")
    assert sorted(got) == sorted(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-12, worst
    print("largest parameter difference to one process:", worst)


def test_exported_folder_reloads_bit_equal(runs):
    from transformers import AutoModelForCausalLM

    from meshwise.checkpoint.consolidated import read_model

    base, out, unbroken = runs
    for name, probe in (("broken", out[0]["resumed"]["logits"]), ("unbroken", unbroken["logits"])):
        folder = base / name / "finetuned"
        saved = read_model(base / name / "checkpoints")  # the checkpoint's whole tensors
        tensors = _tensors(folder)
        assert sorted(tensors) == sorted(saved) and all(torch.equal(tensors[k], saved[k]) for k in saved)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64)
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
        with torch.no_grad():
            logits = model(input_ids=example.make_data(64, 16, 128, 1)["input"][:2]).logits
        if name == "unbroken":
            assert torch.equal(logits, probe)  # the same parameters and the same one-process arithmetic
        else:
            assert (logits - probe).abs().max().item() <= 1e-12  # the tp=4 model sums its rows in another order


def test_export_into_a_folder_holding_another_model_is_refused(runs):
    from meshwise.checkpoint import export_hf
    from meshwise.checkpoint.export import run_cli
    from meshwise.errors import CheckpointError

    base, _, _ = runs
    occupied = base / "unbroken" / "pretrained"  # another model: the start, not the fine-tuned one
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in occupied.iterdir()}
    with pytest.raises(CheckpointError, match="already holds a model .*config.json.*model.safetensors"):
        export_hf(base / "broken" / "checkpoints", occupied, config=occupied)
    with pytest.raises(CheckpointError, match="already holds a model"):
        run_cli([str(base / "broken" / "checkpoints"), str(occupied), "--hf", "--config", str(occupied)])
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in occupied.iterdir()} == files
