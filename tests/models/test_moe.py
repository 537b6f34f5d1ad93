"""Qwen3-MoE: the mixture-of-experts block against HF transformers, the hub's per-expert checkpoint
layout, routing's tie rule and batch invariance, the real models' shapes."""

import dataclasses

import pytest
import torch

from rlactors.models import DecoderForCausalLM, from_pretrained, save_pretrained
from rlactors.models.checkpoint import load_args, load_state_dict, model_shapes, open_tensors
from rlactors.models.moe import SparseMoeBlock, grouped_linear, linear_per_expert, load_balancing_loss, top_k_experts
from rlactors.models.tiny import make_tiny_checkpoint, random_state_dict, size_args
from rlactors.on_policy import ops
from rlactors.on_policy.attention import BatchInvariantAttention
from rlactors.on_policy.modules import to_batch_invariant


def hf_model(ckpt_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(ckpt_dir), dtype=torch.float32).eval()


def moe_checkpoint(tmp_path, seed=2, **moe_changes):
    """A tiny untied qwen3_moe checkpoint with ``moe_changes`` to its experts' config."""
    args = size_args("tiny", 1024, tie_word_embeddings=False, family="qwen3_moe")
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, **moe_changes))
    return save_pretrained(random_state_dict(args, seed), args, tmp_path)


def packed_docs(lengths, vocab_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]
    return docs, torch.cat(docs), torch.cat([torch.arange(n) for n in lengths])


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "true_on_policy"])
@pytest.mark.parametrize("moe_changes", [
    {"norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": ()},  # layers 1 and 3 sparse
    {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": (0, 2)},
], ids=["no_renorm_every_second_layer", "renorm_mlp_only_layers"])
def test_routing_configs_match_hf_transformers(moe_changes, batch_invariant, tmp_path):
    ckpt = moe_checkpoint(tmp_path, **moe_changes)
    ours = from_pretrained(ckpt, dtype=torch.float32)
    if batch_invariant:
        to_batch_invariant(ours)
    ref = hf_model(ckpt)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == [False, True, False, True]
    assert [type(layer.mlp).__name__ for layer in ref.model.layers] == [
        "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]
    lengths = [29, 6, 17]
    docs, input_ids, positions = packed_docs(lengths, ours.args.vocab_size, seed=5)
    targets = torch.randint(0, ours.args.vocab_size, input_ids.shape, generator=torch.Generator().manual_seed(6))
    hidden = ours.forward_packed(input_ids, positions)
    logits = ours.logits(hidden)
    ours.token_logprobs(hidden, targets, chunk_size=16).sum().backward()
    expected = []
    for doc, doc_targets in zip(docs, targets.split(lengths)):
        doc_logits = ref(doc[None]).logits[0]
        doc_logits.log_softmax(-1).gather(-1, doc_targets[:, None]).sum().backward()
        expected.append(doc_logits.detach())
    assert (logits.detach() - torch.cat(expected)).abs().max().item() < 1e-5
    grads = dict(ours.named_parameters())
    for name, param in ref.named_parameters():
        assert param.grad.abs().max() > 0, name  # every expert and router got tokens
        error = (grads[name].grad - param.grad).norm() / param.grad.norm()
        assert error < 1e-4, name


def test_checkpoint_holds_one_tensor_per_expert_and_round_trips_bitwise(family_ckpt, tmp_path):
    ckpt = family_ckpt("qwen3_moe", tie=False)
    on_disk = load_state_dict(ckpt)
    experts = [name for name in on_disk if ".mlp.experts." in name]
    assert len(experts) == 3 * 3 * 8  # 3 sparse layers, 3 projections, 8 experts
    assert on_disk["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (64, 128)
    assert on_disk["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (128, 64)
    assert "model.layers.0.mlp.gate_proj.weight" in on_disk  # the dense first layer
    model = from_pretrained(ckpt)
    fused = model.model.layers[1].mlp.experts
    assert torch.equal(fused.gate_up_proj[7], torch.cat([on_disk["model.layers.1.mlp.experts.7.gate_proj.weight"],
                                                         on_disk["model.layers.1.mlp.experts.7.up_proj.weight"]]))
    assert torch.equal(fused.down_proj[7], on_disk["model.layers.1.mlp.experts.7.down_proj.weight"])
    save_pretrained(model, model.args, tmp_path)
    again = load_state_dict(tmp_path)
    assert again.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert torch.equal(again[name], tensor), name
    assert (tmp_path / "config.json").read_text() == (ckpt / "config.json").read_text()


def test_open_tensors_reads_expert_ranges(family_ckpt, tmp_path):
    model = from_pretrained(family_ckpt("qwen3_moe", tie=False))
    save_pretrained(model, model.args, tmp_path, max_shard_bytes=100_000)  # experts spread over shards
    with open_tensors(tmp_path) as tensors:
        assert tensors.keys() == model_shapes(model.args).keys()
        for name, param in model.named_parameters():
            assert torch.equal(tensors[name][3:6], param[3:6]), name
        assert tensors["model.layers.2.mlp.experts.down_proj"][8:8].shape == (0, 128, 64)


def test_a_checkpoint_missing_an_expert_fails_naming_it(family_ckpt, tmp_path):
    ckpt = family_ckpt("qwen3_moe", tie=False)
    model = from_pretrained(ckpt)
    state_dict = load_state_dict(ckpt)
    del state_dict["model.layers.3.mlp.experts.5.up_proj.weight"]
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    save_file(state_dict, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model.layers.3.mlp.experts.5.up_proj.weight'\]"):
        from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"the state dict to save does not match the config: missing "
                                         r"\['model.layers.1.mlp.experts.down_proj'\]"):
        save_pretrained({k: v for k, v in model.state_dict().items() if "1.mlp.experts.down" not in k},
                        model.args, tmp_path / "out")


@pytest.mark.parametrize("softmax", [lambda logits: logits.float().softmax(-1), ops.softmax],
                         ids=["default", "true_on_policy"])
def test_equal_probabilities_go_to_the_lower_expert(softmax):
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, 0.0],
                           [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, experts = top_k_experts(softmax(logits), top_k=3, renormalize=False)
    assert experts.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert torch.allclose(weights[1], torch.full((3,), 1 / 6))
    weights, _ = top_k_experts(softmax(logits), top_k=3, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(2))


@pytest.mark.parametrize("linear", [grouped_linear, lambda x, w, counts: linear_per_expert(x, w, counts, ops.linear)],
                         ids=["default", "true_on_policy"])
def test_grouped_linear_multiplies_each_group_by_its_expert_even_when_some_get_none(linear):
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(4, 6, 5, generator=g), torch.randn(7, 5, generator=g)
    counts = torch.tensor([3, 0, 4, 0])  # experts 1 and 3 get no rows
    expected = torch.cat([x[:3] @ weight[0].T, x[3:] @ weight[2].T])
    torch.testing.assert_close(linear(x, weight, counts), expected)
    assert linear(x[:0], weight, torch.zeros(4, dtype=torch.long)).shape == (0, 6)


def chosen_experts(model):
    """Records each sparse layer's expert ids per forward (a hook on its experts)."""
    record = []
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.experts.register_forward_hook(lambda module, inputs, output: record.append(inputs[1]))
    return record


def test_true_on_policy_routing_and_hidden_states_do_not_depend_on_the_batch(family_ckpt):
    """A document's experts and hidden states, computed alone and packed among others, in both
    orders: bitwise equal in batch-invariant mode."""
    model = from_pretrained(family_ckpt("qwen3_moe", tie=False))
    to_batch_invariant(model)
    record = chosen_experts(model)
    docs, _, _ = packed_docs([23, 40, 9, 31], model.args.vocab_size, seed=11)
    mine = docs[0]

    def forward(batch):
        positions = torch.cat([torch.arange(len(d)) for d in batch])
        return model(torch.cat(batch), positions, BatchInvariantAttention.from_positions(positions))

    with torch.no_grad():
        alone = forward([mine])
        alone_experts, record[:] = list(record), []
        for others in ([docs[1], docs[2]], [docs[3], docs[2], docs[1]]):
            batch = [*others, mine]
            hidden = forward(batch)
            start = sum(len(d) for d in others)
            assert torch.equal(hidden[start:], alone)
            for layer_alone, layer_batched in zip(alone_experts, record, strict=True):
                assert torch.equal(layer_batched[start:], layer_alone)
            record[:] = []
    assert len(alone_experts) == 3 and len(torch.cat(alone_experts).unique()) == 8  # all experts in use


@pytest.mark.parametrize("size, billions, active_billions", [
    ("30b-a3b", 30.5, 3.3),  # Qwen3-30B-A3B model card: 30.5B parameters, 3.3B activated
    ("235b-a22b", 235, 22),  # Qwen3-235B-A22B model card: 235B parameters, 22B activated
])
def test_real_qwen3_moe_shapes_without_allocating(size, billions, active_billions):
    args = size_args(size, vocab_size=1024, tie_word_embeddings=False, family="qwen3_moe")
    assert (args.moe.num_experts, args.moe.num_experts_per_tok, args.vocab_size) == (128, 8, 151936)
    with torch.device("meta"):
        counted = sum(p.numel() for p in DecoderForCausalLM(args).parameters())
    assert counted == args.num_params()
    assert abs(counted / 1e9 - billions) / billions < 0.01
    assert abs(args.num_active_params() / 1e9 - active_billions) / active_billions < 0.03


def test_the_four_layer_30b_a3b_shape_is_30b_a3b_cut_to_its_first_four_layers():
    full, cut = (size_args(size, vocab_size=1024, family="qwen3_moe") for size in ("30b-a3b", "30b-a3b-4l"))
    assert cut == dataclasses.replace(full, num_hidden_layers=4)
    assert all(cut.is_sparse_layer(i) for i in range(4))


def test_a_checkpoint_without_weights_holds_only_the_config_and_tokenizer(tmp_path):
    """What vLLM serves its dummy weights from, at a shape whose weights (61 GB) fit no test disk."""
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", size="30b-a3b", family="qwen3_moe", weights=False)
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    args = load_args(ckpt)
    assert args == size_args("30b-a3b", vocab_size=1024, family="qwen3_moe", eos_token_id=args.eos_token_id,
                             bos_token_id=args.bos_token_id)
    assert args.num_params() > 30e9


def test_load_balancing_loss():
    even = torch.zeros(16, 4)
    assert load_balancing_loss([even], top_k=2).item() == pytest.approx(1.0)
    skewed = torch.tensor([[4.0, 3.0, 0.0, 0.0]]).repeat(16, 1).requires_grad_()
    loss = load_balancing_loss([skewed, even], top_k=2)
    assert loss.item() > 1.4  # (~1.97 + 1) / 2
    loss.backward()
    assert skewed.grad.abs().max() > 0
