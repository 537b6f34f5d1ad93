"""HF checkpoint directories: round trips, shards, interop with transformers, the tiny factory."""

import dataclasses
import json
import os
import stat

import pytest
import torch
from safetensors import safe_open

from rlactors.models import ModelArgs, copy_tokenizer_files, from_pretrained, load_args, save_pretrained
from rlactors.models.args import FAMILIES, Llama3RopeScaling
from rlactors.models.checkpoint import load_state_dict, open_tensors
from rlactors.models.tiny import main as tiny_main
from rlactors.models.tiny import make_tiny_checkpoint, random_state_dict, size_args


def assert_state_dicts_equal(a, b):
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_ckpt_untied"])
def test_save_load_round_trip_is_bitwise(fixture, request, tmp_path):
    ckpt = request.getfixturevalue(fixture)
    model = from_pretrained(ckpt)
    save_pretrained(model, model.args, tmp_path)
    assert_state_dicts_equal(load_state_dict(tmp_path), load_state_dict(ckpt))
    reloaded = from_pretrained(tmp_path)
    assert_state_dicts_equal(reloaded.state_dict(), model.state_dict())
    assert reloaded.args == model.args
    tied = model.args.tie_word_embeddings
    assert ("lm_head.weight" in load_state_dict(tmp_path)) != tied
    assert (reloaded.lm_head.weight is reloaded.model.embed_tokens.weight) == tied
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_sharded_checkpoint_loads_bitwise_equal(tiny_ckpt_untied, tmp_path):
    from transformers import AutoModelForCausalLM

    model = from_pretrained(tiny_ckpt_untied)
    save_pretrained(model.state_dict(), model.args, tmp_path, max_shard_bytes=600_000)
    shards = sorted(p.name for p in tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 3 and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in model.state_dict().values())
    for shard in shards:  # only an oversized single tensor may exceed the limit
        with safe_open(tmp_path / shard, framework="pt") as f:
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]
        assert sum(sizes) <= 600_000 or len(sizes) == 1
    assert_state_dicts_equal(from_pretrained(tmp_path).state_dict(), model.state_dict())
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_weight_files_get_the_mode_of_the_dirs_other_files(tiny_ckpt, tmp_path, umask):
    """safetensors alone writes 0600; the weights are as readable as config.json and the tokenizer."""
    model = from_pretrained(tiny_ckpt)
    previous = os.umask(umask)
    try:
        save_pretrained(model, model.args, tmp_path / "single")
        copy_tokenizer_files(tiny_ckpt, tmp_path / "single")
        save_pretrained(model, model.args, tmp_path / "sharded", max_shard_bytes=600_000)
    finally:
        os.umask(previous)
    for ckpt in (tmp_path / "single", tmp_path / "sharded"):
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in ckpt.iterdir()}
        assert len(modes) > 3 and set(modes.values()) == {0o666 & ~umask}, modes


@pytest.mark.parametrize("family, tie", [("qwen3", True), ("qwen2", True), ("qwen2", False), ("llama", False),
                                         ("qwen3_moe", False)])
def test_transformers_loads_our_bf16_save_and_we_load_theirs(family, tie, family_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    model = from_pretrained(family_ckpt(family, tie), dtype=torch.bfloat16)
    save_pretrained(model, model.args, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["architectures"] == [FAMILIES[family].architecture] and config["model_type"] == family
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"))
    assert type(hf).__name__ == FAMILIES[family].architecture
    assert hf.dtype == torch.bfloat16 and hf.config.tie_word_embeddings == tie
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) == tie
    assert hf.state_dict().keys() == model.state_dict().keys()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    input_ids = torch.randint(0, model.args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # and computes what we compute (bf16: within its rounding)
        logits = model.logits(model.forward_packed(input_ids[0], torch.arange(24)))
        assert (hf(input_ids).logits[0].float() - logits.float()).abs().max().item() < 3e-2

    hf.save_pretrained(str(tmp_path / "theirs"))
    theirs = from_pretrained(tmp_path / "theirs")
    assert theirs.args == model.args
    assert_state_dicts_equal(theirs.state_dict(), model.state_dict())


def test_from_pretrained_casts_and_places(tiny_ckpt):
    model = from_pretrained(tiny_ckpt, dtype="bfloat16", device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match="dtype must be one of"):
        from_pretrained(tiny_ckpt, dtype="int8")


def test_resave_into_a_sharded_dir_leaves_no_stale_shards(tiny_ckpt, tmp_path):
    model = from_pretrained(tiny_ckpt)
    save_pretrained(model, model.args, tmp_path, max_shard_bytes=500_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    save_pretrained(model, model.args, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert_state_dicts_equal(from_pretrained(tmp_path).state_dict(), model.state_dict())


def test_save_rejects_wrong_names_shapes_and_mixed_dtypes(tiny_ckpt, tmp_path):
    model = from_pretrained(tiny_ckpt)
    state_dict = model.state_dict()
    untied = dataclasses.replace(model.args, tie_word_embeddings=False)
    without_head = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        save_pretrained(without_head, untied, tmp_path)
    prefixed = {f"module.{k}": v for k, v in state_dict.items()}
    with pytest.raises(ValueError, match="unexpected \\['module.lm_head.weight'"):
        save_pretrained(prefixed, model.args, tmp_path)
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        save_pretrained({**state_dict, "model.norm.weight": torch.ones(3)}, model.args, tmp_path)
    with pytest.raises(ValueError, match="one floating dtype"):
        save_pretrained({**state_dict, "model.norm.weight": state_dict["model.norm.weight"].bfloat16()},
                        model.args, tmp_path)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_pretrained(state_dict, model.args, tmp_path, max_shard_bytes=0)
    assert not any(tmp_path.iterdir())  # nothing written by a rejected save


def test_saving_a_tied_model_untied_copies_the_head(tiny_ckpt, tmp_path):
    model = from_pretrained(tiny_ckpt)
    save_pretrained(model, dataclasses.replace(model.args, tie_word_embeddings=False), tmp_path)
    untied = from_pretrained(tmp_path)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert torch.equal(untied.lm_head.weight, model.model.embed_tokens.weight)


def test_load_errors_name_the_problem(tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match="config.json not found"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((tiny_ckpt / "config.json").read_text())
    with pytest.raises(ValueError, match="neither model.safetensors"):
        from_pretrained(tmp_path)
    model = from_pretrained(tiny_ckpt)
    untied = dataclasses.replace(model.args, tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(untied.to_hf_config()))
    (tmp_path / "model.safetensors").write_bytes((tiny_ckpt / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"), open_tensors(tmp_path):
        pass


def test_open_tensors_reads_row_ranges_of_every_shard(tiny_ckpt_untied, tmp_path):
    save_pretrained(from_pretrained(tiny_ckpt_untied), load_args(tiny_ckpt_untied), tmp_path, max_shard_bytes=200_000)
    full = load_state_dict(tmp_path)
    with open_tensors(tmp_path) as tensors:
        assert tensors.keys() == full.keys()
        for name, tensor in full.items():
            assert torch.equal(tensors[name][3:7], tensor[3:7]), name


def test_model_args_read_transformers_4_and_5_configs():
    qwen3_06b = {  # the fields of Qwen/Qwen3-0.6B's config.json (transformers 4.x spelling)
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    }
    args = ModelArgs.from_hf_config(qwen3_06b)
    assert args.model_type == "qwen3" and args.rope_scaling is None
    assert args == size_args("0.6b", 1024, eos_token_id=151645, bos_token_id=151643)
    v5 = {k: v for k, v in qwen3_06b.items() if k not in ("rope_theta", "torch_dtype", "rope_scaling")}
    v5.update(rope_parameters={"rope_type": "default", "rope_theta": 5e5}, dtype="float32")
    args5 = ModelArgs.from_hf_config(v5)
    assert args5.rope_theta == 5e5 and args5.torch_dtype == "float32"
    assert ModelArgs.from_hf_config(args5.to_hf_config()) == args5


# Real config.json files (transformers 4.x spelling), trimmed of keys rlactors does not read.
QWEN25_7B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
}
LLAMA31_8B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}


def test_model_args_read_qwen2_and_llama3_configs():
    qwen = ModelArgs.from_hf_config(QWEN25_7B_INSTRUCT)  # sliding-window keys present but off
    assert (qwen.model_type, qwen.head_dim, qwen.num_key_value_heads, qwen.rope_theta, qwen.rope_scaling,
            qwen.tie_word_embeddings) == ("qwen2", 128, 4, 1e6, None, False)
    llama = ModelArgs.from_hf_config(LLAMA31_8B_INSTRUCT)
    assert (llama.model_type, llama.head_dim, llama.rms_norm_eps, llama.rope_theta, llama.eos_token_id) == (
        "llama", 128, 1e-5, 5e5, [128001, 128008, 128009])
    assert llama.rope_scaling == Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                   original_max_position_embeddings=8192)
    # transformers 5.x spelling: rope_parameters holds the type, theta and scaling.
    v5 = {k: v for k, v in LLAMA31_8B_INSTRUCT.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**LLAMA31_8B_INSTRUCT["rope_scaling"], "rope_theta": 500000.0}
    assert ModelArgs.from_hf_config(v5) == llama
    for args in (qwen, llama):
        assert ModelArgs.from_hf_config(args.to_hf_config()) == args
    # Absent keys take transformers' defaults: untied head, theta 1e4, original context = max positions.
    bare = {k: v for k, v in LLAMA31_8B_INSTRUCT.items() if k not in ("tie_word_embeddings", "rope_theta")}
    bare["rope_scaling"] = {k: v for k, v in bare["rope_scaling"].items() if k != "original_max_position_embeddings"}
    defaults = ModelArgs.from_hf_config(bare)
    assert not defaults.tie_word_embeddings and defaults.rope_theta == 1e4
    assert defaults.rope_scaling.original_max_position_embeddings == 131072


@pytest.mark.parametrize("family, change, message", [
    ("qwen3", {"model_type": "mistral"}, "model_type 'mistral'"),
    ("qwen3", {"model_type": None}, "model_type None"),
    ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope_type 'yarn'"),
    ("qwen2", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}},
     r"missing \['high_freq_factor'\]"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                                "original_max_position_embeddings": 8192}}, "high_freq_factor must exceed"),
    ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3", {"hidden_size": None}, "missing"),
    ("qwen3_moe", {"num_experts": 0}, "num_experts must be a positive int, got 0"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) must not exceed num_experts \(8\)"),
    ("qwen3_moe", {"moe_intermediate_size": 1.5}, "moe_intermediate_size must be a positive int"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive int"),
    ("qwen3_moe", {"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
    ("qwen3_moe", {"mlp_only_layers": [0, 4]}, r"mlp_only_layers \[0, 4\] name layers beyond num_hidden_layers \(4\)"),
    ("qwen3_moe", {"mlp_only_layers": [-1]}, "mlp_only_layers must list layer indices"),
    ("qwen3_moe", {"router_aux_loss_coef": -1}, "router_aux_loss_coef must be a number >= 0"),
    ("qwen3_moe", {"output_router_logits": True}, "output_router_logits"),
])
def test_model_args_reject_unsupported_configs(family, change, message):
    config = {**size_args("tiny", 1024, family=family).to_hf_config(), **change}
    config = {k: v for k, v in config.items() if v is not None or k not in change or k == "model_type"}
    with pytest.raises(ValueError, match=message) as error:
        ModelArgs.from_hf_config(config)
    assert "\n" not in str(error.value)  # one line


def test_a_checkpoint_of_another_family_fails_at_load_naming_its_model_type(tiny_ckpt, tmp_path):
    for name in ("model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_bytes((tiny_ckpt / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**load_args(tiny_ckpt).to_hf_config(), "model_type": "gemma2"}))
    with pytest.raises(ValueError, match=r"^config.json has model_type 'gemma2'; rlactors supports \['llama', "
                                         r"'qwen2', 'qwen3', 'qwen3_moe'\]$"):
        from_pretrained(tmp_path)


def test_copy_tokenizer_files(tiny_ckpt, tmp_path):
    copied = copy_tokenizer_files(tiny_ckpt, tmp_path / "out")
    assert sorted(copied) == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    for name in copied:
        assert (tmp_path / "out" / name).read_bytes() == (tiny_ckpt / name).read_bytes()
    with pytest.raises(ValueError, match="no tokenizer files"):
        copy_tokenizer_files(tmp_path / "out" / "nothing_here", tmp_path / "dst")


def test_tiny_factory_is_deterministic(tiny_ckpt, tmp_path):
    again = make_tiny_checkpoint(tmp_path / "again", size="tiny", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json",
                 "generation_config.json"):
        assert (again / name).read_bytes() == (tiny_ckpt / name).read_bytes(), name
    other_seed = random_state_dict(load_args(tiny_ckpt), seed=1)
    assert not torch.equal(other_seed["model.embed_tokens.weight"],
                           load_state_dict(tiny_ckpt)["model.embed_tokens.weight"])


def test_tiny_checkpoint_shape_and_files(tiny_ckpt):
    from transformers import AutoTokenizer

    args = load_args(tiny_ckpt)
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt), local_files_only=True)
    assert len(tok) == args.vocab_size == 1024  # no padded rows: every model id decodes
    assert (args.hidden_size, args.num_hidden_layers, args.num_attention_heads, args.num_key_value_heads,
            args.head_dim, args.intermediate_size) == (128, 4, 4, 2, 32, 384)
    assert args.torch_dtype == "float32" and args.tie_word_embeddings
    assert args.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    generation = json.loads((tiny_ckpt / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.eos_token_id, tok.pad_token_id]
    text = "<alphabetical_sorted>\nMary Smith\n</alphabetical_sorted>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) <= 16
    assert tok.decode(tok.encode("Ünïcode ☃ still encodes", add_special_tokens=False)) == "Ünïcode ☃ still encodes"


def test_tiny_cli_writes_untied_small_checkpoint(tmp_path, capsys):
    tiny_main([str(tmp_path / "small"), "--size", "small", "--seed", "3", "--no-tie", "--dtype", "bfloat16"])
    assert "wrote small qwen3 checkpoint" in capsys.readouterr().out
    args = load_args(tmp_path / "small")
    assert (args.hidden_size, args.num_hidden_layers, args.tie_word_embeddings, args.torch_dtype) == (
        256, 6, False, "bfloat16")
    model = from_pretrained(tmp_path / "small")
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="size must be one of"):
        make_tiny_checkpoint(tmp_path / "bad", size="huge")


def test_tiny_cli_writes_each_family(tmp_path, capsys):
    tiny_main([str(tmp_path / "llama"), "--family", "llama", "--no-tie"])
    assert "wrote tiny llama checkpoint" in capsys.readouterr().out
    llama = load_args(tmp_path / "llama")
    assert (llama.model_type, llama.tie_word_embeddings, llama.rope_theta) == ("llama", False, 5e5)
    assert llama.rope_scaling.original_max_position_embeddings == 8192 < llama.max_position_embeddings
    tiny_main([str(tmp_path / "qwen2"), "--family", "qwen2"])
    qwen2 = from_pretrained(tmp_path / "qwen2")
    assert qwen2.args.model_type == "qwen2" and qwen2.args.rope_scaling is None
    bias = qwen2.model.layers[0].self_attn.k_proj.bias
    assert bias.shape == (qwen2.args.num_key_value_heads * qwen2.args.head_dim,) and bias.abs().max() > 0
    with pytest.raises(SystemExit):  # the Qwen3 shapes are not Llama's
        tiny_main([str(tmp_path / "bad"), "--family", "llama", "--size", "0.6b"])
    assert "size must be one of ['tiny', 'small', '1b'] for family 'llama'" in capsys.readouterr().err
