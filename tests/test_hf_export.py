"""export_hf / ``meshwise export --hf`` and load_hf: a Llama trained under FSDP2 at dp=2, saved by the
Checkpointer, exported to a Hugging Face folder that ``from_pretrained`` loads with bit-equal logits and that load_hf
reads back into a sharded model; key mismatches and occupied folders are refused, and load_hf refuses a folder whose
config.json, keys or shapes differ from the model's before reading anything."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from meshwise.testing import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

IDS = torch.arange(16).reshape(2, 8) * 3 % 64


def llama_config(tied: bool, **overrides):
    from transformers import LlamaConfig

    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    return LlamaConfig(**{**sizes, "intermediate_size": 64, "tie_word_embeddings": tied, **overrides})


def _train_and_save(topo, roots: dict) -> dict:
    from transformers import LlamaForCausalLM

    import meshwise
    from meshwise.checkpoint import export_hf, load_hf

    out = {}
    for tied, root in roots.items():
        torch.manual_seed(0)  # the same full weights on every rank, then sharded
        model = meshwise.parallelize(LlamaForCausalLM(llama_config(tied)).to(torch.float64), topo, dp="fsdp")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        rows = slice(topo.data_rank, topo.data_rank + 1)
        model(input_ids=IDS[rows], labels=IDS[rows]).loss.backward()
        opt.step()
        ck = meshwise.Checkpointer(root, topo)
        ck.save(1, model=model, optimizer=opt)
        ck.close()
        with torch.no_grad():
            out[tied] = model(input_ids=IDS).logits  # FSDP2 gathers: the whole model's logits on every rank
        # and back in: rank 0 exports, then every rank loads its shards of it into a fresh sharded model
        folder = f"{root}-hf"
        if topo.rank == 0:
            export_hf(root, folder, config=llama_config(tied))
        torch.distributed.barrier()
        torch.manual_seed(1)
        fresh = meshwise.parallelize(LlamaForCausalLM(llama_config(tied)).to(torch.float64), topo, dp="fsdp")
        load_hf(folder, fresh)
        with torch.no_grad():
            out[f"loaded-{tied}"] = fresh(input_ids=IDS).logits
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf_export")
    roots = {tied: str(base / f"tied-{tied}") for tied in (False, True)}
    logits = run_distributed(_train_and_save, 2, roots, mesh={"dp": 2}, timeout=120)
    assert torch.equal(logits[0][False], logits[1][False])
    for r in logits:  # load_hf into a sharded model at dp=2 gives the trained model's logits
        for tied in (False, True):
            assert torch.equal(r[f"loaded-{tied}"], r[tied])
    return roots, logits[0]


@pytest.mark.parametrize("tied", [False, True])
def test_export_hf_loads_with_from_pretrained_and_equal_logits(saved, tmp_path, tied):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from meshwise.checkpoint import export_hf

    roots, logits = saved
    out = export_hf(roots[tied], tmp_path / "hf", config=llama_config(tied))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) is not tied  # a tied head is written once, as save_pretrained does
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64)
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, logits[tied])


def test_sharded_export_and_the_command_line(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    from meshwise.checkpoint.export import run_cli

    roots, logits = saved
    llama_config(False).save_pretrained(str(tmp_path / "cfg"))
    # 20 kB shards: the weights (about 110 kB in float64) split into several files under one index
    from meshwise.checkpoint import export_hf

    out = export_hf(roots[False], tmp_path / "sharded", config=tmp_path / "cfg" / "config.json", max_shard_size=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (out / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, logits[False])
    assert run_cli([roots[False], str(tmp_path / "cli"), "--hf", "--config", str(tmp_path / "cfg")]) == 0
    assert (tmp_path / "cli" / "model.safetensors").is_file() and (tmp_path / "cli" / "config.json").is_file()


def test_load_hf_in_one_process_and_its_refusals(saved, tmp_path):
    from transformers import LlamaForCausalLM

    from meshwise.checkpoint import load_hf
    from meshwise.errors import CheckpointError

    roots, logits = saved
    model = LlamaForCausalLM(llama_config(True)).to(torch.float64)
    load_hf(f"{roots[True]}-hf", model)  # the folder the launch exported
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, logits[True])
    untied = LlamaForCausalLM(llama_config(False)).to(torch.float64)
    before = {k: v.clone() for k, v in untied.state_dict().items()}
    # the folder's config.json is checked first, naming the fields that differ
    with pytest.raises(CheckpointError, match=r"tie_word_embeddings: folder True, model False"):
        load_hf(f"{roots[True]}-hf", untied)
    other_eps = LlamaForCausalLM(llama_config(True, rms_norm_eps=1e-5)).to(torch.float64)
    with pytest.raises(CheckpointError, match=r"rms_norm_eps: folder 1e-06, model 1e-05"):
        load_hf(f"{roots[True]}-hf", other_eps)
    # weights alone (no config.json): the keys and shapes are checked
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(f"{roots[True]}-hf/model.safetensors", bare)
    with pytest.raises(CheckpointError, match=r"missing \['lm_head.weight'\], unexpected \[\]"):
        load_hf(bare, untied)
    deeper = LlamaForCausalLM(llama_config(True, num_hidden_layers=3)).to(torch.float64)
    with pytest.raises(CheckpointError, match=r"missing \['model.layers.2.input_layernorm.weight'"):
        load_hf(bare, deeper)
    deeper.save_pretrained(str(tmp_path / "deeper"))  # and the other way: a key left over in the folder
    (tmp_path / "deeper" / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"missing \[\], unexpected \['model.layers.2.input_layernorm.weight'"):
        load_hf(tmp_path / "deeper", LlamaForCausalLM(llama_config(True)).to(torch.float64))
    wider = LlamaForCausalLM(llama_config(True, vocab_size=128)).to(torch.float64)
    with pytest.raises(CheckpointError, match=r"model.embed_tokens.weight: folder \(64, 32\), model \(128, 32\)"):
        load_hf(bare, wider)
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_hf(tmp_path / "absent", untied)
    assert all(torch.equal(v, before[k]) for k, v in untied.state_dict().items())  # refused: nothing was read


def test_refusals_write_nothing(saved, tmp_path):
    from meshwise.checkpoint import export_hf
    from meshwise.errors import CheckpointError

    roots, _ = saved
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "config.json").write_text("{}")
    (occupied / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="already holds a model .*config.json"):
        export_hf(roots[False], occupied, config=llama_config(False))
    assert sorted(p.name for p in occupied.iterdir()) == ["config.json", "tokenizer.json"]
    assert (occupied / "config.json").read_text() == "{}"

    other = tmp_path / "other"
    other.mkdir()
    (other / "model-00001-of-00002.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="already holds a model"):
        export_hf(roots[False], other, config=llama_config(False))

    # a config with another layer count: the checkpoint's keys do not fit, named in the error
    wrong = llama_config(False)
    wrong.num_hidden_layers = 3
    with pytest.raises(CheckpointError, match=r"missing \['model.layers.2"):
        export_hf(roots[False], tmp_path / "wrong", config=wrong)
    assert not (tmp_path / "wrong").exists()
    with pytest.raises(CheckpointError, match="no config.json"):
        export_hf(roots[False], tmp_path / "nocfg", config=tmp_path / "absent")
