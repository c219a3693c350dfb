"""Pretrained weights: every source format, the key checks and their messages, and the export to safetensors."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from helpers.models import TinyGPT
from safetensors.torch import load_file, save_file

from lightning_varuna.checkpoint import CheckpointError
from lightning_varuna.checkpoint.job import write_single
from lightning_varuna.checkpoint.plain_format import main as convert_main
from lightning_varuna.checkpoint.plain_format import to_safetensors
from lightning_varuna.checkpoint.pretrained import InitialWeights, ModelLayout, load_initial_weights, open_weights


def _model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(n_layer=2, tie_weights=True, head_alias=True)


def _hf_state(model: TinyGPT) -> dict[str, torch.Tensor]:
    """As Hugging Face saves it: the tied head left out."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}


def _sources(tmp_path: Path, model: TinyGPT) -> dict[str, Path]:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hf = _hf_state(model)
    paths = {}
    paths["torch.save"] = tmp_path / "weights.pt"
    torch.save(state, paths["torch.save"])
    paths["lightning"] = tmp_path / "model.ckpt"
    torch.save({"state_dict": state, "epoch": 3, "hyper_parameters": {"n_layer": 2}}, paths["lightning"])
    paths["safetensors"] = tmp_path / "weights.safetensors"
    save_file(hf, paths["safetensors"])
    single = tmp_path / "hf-single"
    single.mkdir()
    save_file(hf, single / "model.safetensors", metadata={"format": "pt"})
    paths["hf folder"] = single
    sharded = tmp_path / "hf-sharded"
    sharded.mkdir()
    keys = sorted(hf)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in shards.items():
        save_file({k: hf[k] for k in part}, sharded / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    paths["hf sharded"] = sharded
    binary = tmp_path / "hf-bin"
    binary.mkdir()
    torch.save(hf, binary / "pytorch_model.bin")
    paths["hf bin"] = binary
    names = [n for n, _ in model.named_parameters()]
    paths["strategy checkpoint"] = tmp_path / "sharded.ckpt"
    write_single(paths["strategy checkpoint"], {"state_dict": state}, {"global_step": 1}, [], names)
    return paths


def test_every_format_loads_the_same_weights_through_the_checks(tmp_path: Path) -> None:
    source = _model(seed=1)
    layout = ModelLayout.of(source)
    assert layout.aliases["lm_head.weight"] == ["wte.weight"]
    for kind, path in _sources(tmp_path, source).items():
        target = _model(seed=2)
        load_initial_weights(path, target, layout.shapes, layout.aliases)
        for name, value in source.state_dict().items():
            assert torch.equal(target.state_dict()[name], value), (kind, name)
        assert target.lm_head.weight is target.wte.weight


def test_only_the_tensors_a_stage_holds_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_varuna.checkpoint import pretrained
    from lightning_varuna.pipeline.model.stand_ins import free_parameter

    source = _model(seed=1)
    layout = ModelLayout.of(source)
    path = _sources(tmp_path, source)["hf sharded"]
    read: list[str] = []
    copy_into = pretrained._SafeTensors.copy_into
    monkeypatch.setattr(pretrained._SafeTensors, "copy_into", lambda self, targets: (read.extend(targets),
                                                                                     copy_into(self, targets)))
    target = _model(seed=2)
    # a partitioned model's state_dict lacks the other stages' parameters
    free_parameter(target, "blocks.1.mlp.0.weight")
    free_parameter(target, "wte.weight")
    load_initial_weights(path, target, layout.shapes, layout.aliases)
    assert torch.equal(target.blocks[0].mlp[0].weight, source.blocks[0].mlp[0].weight)
    assert sorted(read) == sorted(k for k in source.state_dict() if k not in (
        "blocks.1.mlp.0.weight", "wte.weight", "lm_head.weight"))
    assert target.blocks[1].mlp[0].weight.stride() == (0, 0)


def test_a_prefix_maps_the_files_keys_into_a_wrapping_module(tmp_path: Path) -> None:
    source = _model(seed=1)
    path = tmp_path / "hf.safetensors"
    save_file(_hf_state(source), path)
    wrapper = torch.nn.Module()
    wrapper.model = _model(seed=2)
    layout = ModelLayout.of(wrapper)
    InitialWeights(path, prefix="model.").load(wrapper, layout)
    assert torch.equal(wrapper.model.ln_f.weight, source.ln_f.weight)
    with pytest.raises(CheckpointError, match=r"not in it: model\.pos, model\.wte\.weight.*initial_weights_prefix"):
        InitialWeights(path).load(wrapper, layout)


def test_missing_extra_and_misshapen_keys_are_named_with_a_count(tmp_path: Path) -> None:
    source = _model(seed=1)
    layout = ModelLayout.of(source)
    state = _hf_state(source)
    cases = {
        "missing": ({k: v for k, v in state.items() if not k.startswith("blocks.1.")},
                    r"12 key\(s\) of the model are not in it: blocks\.1\.\S+, .* and 7 more"),
        "extra": ({**state, "blocks.9.attn.qkv.weight": torch.zeros(2)},
                  r"1 of its key\(s\) are not in the model: blocks\.9\.attn\.qkv\.weight\."),
        "shape": ({**state, "ln_f.weight": torch.zeros(31)},
                  r"1 shape\(s\) differ: ln_f\.weight \(31,\) in the file, \(32,\) in the model"),
    }
    for name, (weights, message) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(weights, path)
        with pytest.raises(CheckpointError, match=message):
            load_initial_weights(path, _model(seed=2), layout.shapes, layout.aliases)
    # leniency only when asked for: missing and extra keys become a warning, a wrong shape stays an error
    target = _model(seed=2)
    with pytest.warns(UserWarning, match="not in it"):
        InitialWeights(tmp_path / "missing.safetensors", strict=False).load(target, layout)
    assert torch.equal(target.blocks[0].ln_1.weight, source.blocks[0].ln_1.weight)
    with pytest.raises(CheckpointError, match="shape"):
        InitialWeights(tmp_path / "shape.safetensors", strict=False).load(target, layout)


def test_unusable_paths_say_what_is_expected(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        open_weights(tmp_path / "nowhere.pt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="folder without weights.*model.safetensors.index.json"):
        open_weights(tmp_path / "empty")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot be read"):
        open_weights(tmp_path / "junk.pt")
    torch.save({"epoch": 1}, tmp_path / "nostate.pt")
    with pytest.raises(CheckpointError, match="holds no state dict"):
        open_weights(tmp_path / "nostate.pt")
    with pytest.raises(ValueError, match="initial_weights_prefix"):
        InitialWeights("x", prefix=None)  # type: ignore[arg-type]


def test_convert_writes_safetensors_a_wrapped_model_loads_back(tmp_path: Path) -> None:
    wrapper = torch.nn.Module()
    wrapper.model = _model(seed=1)
    wrapper.other = torch.nn.Linear(2, 2)
    state = {k: v.detach().clone() for k, v in wrapper.state_dict().items()}
    names = [n for n, _ in wrapper.named_parameters()]
    write_single(tmp_path / "run.ckpt", {"state_dict": state}, {"global_step": 1}, [], names)
    torch.save({"state_dict": wrapper.state_dict()}, tmp_path / "plain.ckpt")  # the tied head shares memory here
    for src in ("run.ckpt", "plain.ckpt"):
        out = tmp_path / f"{src}.safetensors"
        assert convert_main(["to-safetensors", str(tmp_path / src), str(out), "--strip-prefix", "model."]) == 0
        loaded = load_file(out)
        assert set(loaded) == set(wrapper.model.state_dict())
        fresh = _model(seed=3)
        fresh.load_state_dict(loaded)
        assert torch.equal(fresh.blocks[1].attn.qkv.weight, wrapper.model.blocks[1].attn.qkv.weight)
    with pytest.raises(CheckpointError, match="no weights whose name starts with 'nope.'"):
        to_safetensors(tmp_path / "run.ckpt", tmp_path / "x.safetensors", strip_prefix="nope.")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert to_safetensors(tmp_path / "run.ckpt", tmp_path / "all.safetensors") == len(state)


def _holder(model: torch.nn.Module) -> torch.nn.Module:
    holder = torch.nn.Module()
    holder.model = model
    return holder


def test_a_transformers_folder_with_legacy_key_names_loads_as_from_pretrained_loads_it(tmp_path: Path) -> None:
    """transformers 5 writes ViT's and GPT-NeoX's old key names; they are renamed as transformers renames them."""
    transformers = pytest.importorskip("transformers")
    models = {
        "vit": lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=8,
            patch_size=4)),
        "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)),
    }
    for name, build in models.items():
        torch.manual_seed(0)
        source = build()
        source.save_pretrained(tmp_path / name)
        files = set(open_weights(tmp_path / name).shapes)
        assert files - set(source.state_dict()), f"{name}: the folder holds names the module does not have"
        torch.manual_seed(1)
        target = _holder(build())
        InitialWeights(str(tmp_path / name), prefix="model.").load(target, ModelLayout.of(target))
        for key, value in source.state_dict().items():
            assert torch.equal(target.model.state_dict()[key], value), f"{name}: {key}"


def test_a_transformers_conversion_that_merges_tensors_is_refused_naming_the_key(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2)
    source = transformers.MixtralForCausalLM(config)
    source.save_pretrained(tmp_path / "mixtral")
    if not any(".experts.0." in key for key in open_weights(tmp_path / "mixtral").shapes):
        pytest.skip("this transformers version saves Mixtral's experts stacked: nothing to convert")
    target = _holder(transformers.MixtralForCausalLM(config))
    with pytest.raises(CheckpointError, match=r"initial_weights: the key model\.layers\.0\..*experts.*is converted"):
        InitialWeights(str(tmp_path / "mixtral"), prefix="model.").load(target, ModelLayout.of(target))
