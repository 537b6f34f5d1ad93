"""The decoder of every family and packed attention, checked against HF transformers and explicit references."""

import math

import pytest
import torch

from rlactors.attention.varlen import cu_seqlens_from_positions
from rlactors.models import DecoderForCausalLM, ModelArgs, VarlenAttention, from_pretrained
from rlactors.models.args import FAMILIES
from rlactors.models.decoder import LogSoftmax, rope_inverse_frequencies
from rlactors.models.moe import SparseMoeBlock
from rlactors.models.tiny import size_args
from rlactors.on_policy.attention import BatchInvariantAttention
from rlactors.on_policy.modules import to_batch_invariant


def hf_model(ckpt_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(ckpt_dir), dtype=torch.float32).eval()


def random_docs(lengths, vocab_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]
    return docs, torch.cat(docs), torch.cat([torch.arange(n) for n in lengths])


def relative_error(actual, expected):
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_logits_and_gradients_match_hf_transformers_per_document(family, tie, family_ckpt):
    ckpt = family_ckpt(family, tie)
    ours = from_pretrained(ckpt, dtype=torch.float32)
    ref = hf_model(ckpt)
    assert type(ref).__name__ == FAMILIES[family].architecture
    attention = ours.model.layers[0].self_attn
    assert (attention.q_proj.bias is not None) == (family == "qwen2")  # the family's switches
    assert (attention.q_norm is not None) == family.startswith("qwen3")
    assert isinstance(ours.model.layers[1].mlp, SparseMoeBlock) == (family == "qwen3_moe")
    assert (ours.args.rope_scaling is not None) == (family == "llama")
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie
    assert ours.args.num_key_value_heads < ours.args.num_attention_heads  # GQA is exercised
    lengths = [37, 5, 20]
    docs, input_ids, positions = random_docs(lengths, ours.args.vocab_size, seed=3)
    gen = torch.Generator().manual_seed(4)
    targets = torch.randint(0, ours.args.vocab_size, input_ids.shape, generator=gen)
    upstream = torch.randn(input_ids.shape, generator=gen)  # d loss / d logprobs

    # Ours: the documents packed into one sequence. HF: one forward per document.
    hidden = ours.forward_packed(input_ids, positions)
    logits = ours.logits(hidden)
    (ours.token_logprobs(hidden, targets, chunk_size=16) * upstream).sum().backward()
    expected = []
    for doc, doc_targets, doc_upstream in zip(docs, targets.split(lengths), upstream.split(lengths)):
        doc_logits = ref(doc[None]).logits[0]
        logprobs = doc_logits.log_softmax(-1).gather(-1, doc_targets[:, None]).squeeze(-1)
        (logprobs * doc_upstream).sum().backward()
        expected.append(doc_logits.detach())
    assert logits.abs().max() > 0.1  # a non-degenerate comparison
    assert (logits.detach() - torch.cat(expected)).abs().max().item() < 1e-5
    grads = {name: p.grad for name, p in ours.named_parameters()}
    expected_grads = {name: p.grad for name, p in ref.named_parameters()}
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        assert grad.abs().max() > 0, name
        assert relative_error(grads[name], grad) < 1e-5, name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_true_on_policy_gradients_match_hf_transformers(family, device, family_ckpt):
    """The batch-invariant forward (CPU: exact matmuls; CUDA: Triton kernels, whose outputs have
    no autograd graph of their own) still gives every parameter HF's gradient."""
    ckpt = family_ckpt(family, False)
    ours = from_pretrained(ckpt, dtype=torch.float32, device=device)
    to_batch_invariant(ours)
    ref = hf_model(ckpt)
    lengths = [37, 5, 20]
    docs, input_ids, positions = random_docs(lengths, ours.args.vocab_size, seed=3)
    gen = torch.Generator().manual_seed(4)
    targets = torch.randint(0, ours.args.vocab_size, input_ids.shape, generator=gen)
    upstream = torch.randn(input_ids.shape, generator=gen)
    input_ids, positions = input_ids.to(device), positions.to(device)
    # The backward's reference attention: sdpa, which runs fp32 on CUDA too (flash kernels do not).
    hidden = ours(input_ids, positions, BatchInvariantAttention.from_positions(positions, backend="sdpa"))
    (ours.token_logprobs(hidden, targets.to(device), chunk_size=16) * upstream.to(device)).sum().backward()
    for doc, doc_targets, doc_upstream in zip(docs, targets.split(lengths), upstream.split(lengths)):
        logprobs = ref(doc[None]).logits[0].log_softmax(-1).gather(-1, doc_targets[:, None]).squeeze(-1)
        (logprobs * doc_upstream).sum().backward()
    grads = {name: p.grad for name, p in ours.named_parameters()}
    for name, expected in ref.named_parameters():
        assert grads[name] is not None, name
        assert expected.grad.abs().max() > 0, name
        assert relative_error(grads[name].cpu(), expected.grad) < 1e-4, name


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parameter_names_match_hf(family, family_ckpt):
    ckpt = family_ckpt(family, tie=False)
    ours = from_pretrained(ckpt)
    ref = hf_model(ckpt)
    assert list(ours.state_dict()) == list(ref.state_dict())
    for name, tensor in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name


def test_llama3_rope_scaling_matches_hf_beyond_the_original_context(family_ckpt):
    ckpt = family_ckpt("llama", tie=False)
    ours, ref = from_pretrained(ckpt, dtype=torch.float32), hf_model(ckpt)
    args = ours.args
    assert args.rope_scaling.original_max_position_embeddings == 8192
    assert torch.equal(ours.model.inv_freq, ref.model.rotary_emb.inv_freq)  # HF's, bit for bit
    # All three bands of the scaling are exercised: kept, divided by the factor, interpolated.
    unscaled = rope_inverse_frequencies(args.head_dim, args.rope_theta)
    ratio = unscaled / ours.model.inv_freq
    assert (ratio == 1).any() and (ratio == args.rope_scaling.factor).any()
    assert ((ratio > 1) & (ratio < args.rope_scaling.factor)).any()

    # Sharper attention than random init's near-uniform one, in both models, so that positions matter.
    with torch.no_grad():
        for model in (ours, ref):
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(16)
                layer.self_attn.k_proj.weight.mul_(16)
    # One document at positions 9000 .. 9047, past the original context.
    input_ids = torch.randint(0, args.vocab_size, (48,), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(9000, 9048)
    one_document = VarlenAttention(torch.tensor([0, 48], dtype=torch.int32), 48)
    with torch.no_grad():
        expected = ref(input_ids[None], position_ids=positions[None]).logits[0]
        logits = ours.logits(ours(input_ids, positions, one_document))
        ours.model.inv_freq = unscaled
        without_scaling = ours.logits(ours(input_ids, positions, one_document))
    assert (logits - expected).abs().max().item() < 1e-5
    assert (without_scaling - expected).abs().max().item() > 0.05  # the scaling matters there


def test_packed_documents_equal_separate_forwards(tiny_ckpt):
    model = from_pretrained(tiny_ckpt)
    docs, input_ids, positions = random_docs([11, 5, 17], model.args.vocab_size)
    targets = torch.randint(0, model.args.vocab_size, input_ids.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        packed = model.token_logprobs(model.forward_packed(input_ids, positions), targets)
        separate = torch.cat([
            model.token_logprobs(model.forward_packed(doc, torch.arange(len(doc))), t)
            for doc, t in zip(docs, targets.split([11, 5, 17]))])
    assert (packed - separate).abs().max().item() < 1e-5


def test_attention_never_crosses_documents(tiny_ckpt):
    model = from_pretrained(tiny_ckpt)
    docs, input_ids, positions = random_docs([8, 8, 8], model.args.vocab_size)
    changed = input_ids.clone()
    changed[:8] = (changed[:8] + 1) % model.args.vocab_size  # rewrite the first document only
    with torch.no_grad():
        before = model.forward_packed(input_ids, positions)
        after = model.forward_packed(changed, positions)
    assert (after[:8] - before[:8]).abs().max() > 1e-3
    assert (after[8:] - before[8:]).abs().max().item() < 1e-6


def test_rope_follows_positions_not_token_index(tiny_ckpt):
    model = from_pretrained(tiny_ckpt)
    docs, input_ids, positions = random_docs([13, 6], model.args.vocab_size)
    one_document = VarlenAttention(torch.tensor([0, 6], dtype=torch.int32), 6)
    with torch.no_grad():
        packed = model.forward_packed(input_ids, positions)[13:]
        alone = model(docs[1], torch.arange(6), one_document)
        # RoPE is relative, so only a change of distances between positions may change the output.
        stretched = model(docs[1], torch.arange(6) * 2, one_document)
    assert (packed - alone).abs().max().item() < 1e-5
    assert (stretched - alone).abs().max().item() > 1e-3


def reference_attention(q, k, v, lengths):
    """Per-document causal softmax attention written out by hand, GQA by repeating kv heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        scores = qs @ ks.transpose(1, 2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_sdpa_backend_matches_reference(kv_heads):
    lengths = [7, 1, 12, 4]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths), 4, 16, generator=gen)
    k, v = (torch.randn(sum(lengths), kv_heads, 16, generator=gen) for _ in range(2))
    positions = torch.cat([torch.arange(n) for n in lengths])
    attention = VarlenAttention.from_positions(positions, backend="sdpa")
    assert attention.cu_seqlens.tolist() == [0, 7, 8, 20, 24]
    assert attention.max_seqlen == 12 and attention.num_documents == 4
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = attention(0, q, k, v)
    expected = reference_attention(q, k, v, lengths)
    assert out.shape == q.shape
    assert (out - expected).abs().max().item() < 1e-5
    weights = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for grad, expected_grad in zip(grads, expected_grads):
        assert (grad - expected_grad).abs().max().item() < 1e-5


def test_auto_backend_is_sdpa_on_cpu():
    assert VarlenAttention.from_positions(torch.arange(4)).backend == "sdpa"


@pytest.mark.parametrize("positions, message", [
    ([1, 2, 3], "start at 0"),
    ([0, 1, 3], "count up by 1"),
    ([0, 1, 0, 2], "count up by 1"),
    ([], "non-empty 1-D"),
    ([[0, 1], [0, 1]], "non-empty 1-D"),
])
def test_bad_positions_are_rejected(positions, message):
    with pytest.raises(ValueError, match=message):
        cu_seqlens_from_positions(torch.tensor(positions, dtype=torch.long))


@pytest.mark.parametrize("backend, message", [
    ("nope", "must be one of"), ("varlen", "needs CUDA"), ("flash", "needs CUDA")])
def test_unusable_backends_are_rejected(backend, message):
    with pytest.raises(ValueError, match=message):
        VarlenAttention.from_positions(torch.arange(4), backend=backend)


def test_attention_rejects_mismatched_token_count():
    attention = VarlenAttention.from_positions(torch.arange(4))
    q = torch.zeros(5, 2, 8)
    with pytest.raises(ValueError, match="4 packed tokens"):
        attention(0, q, q, q)


def test_model_rejects_2d_input(tiny_ckpt):
    model = from_pretrained(tiny_ckpt)
    with pytest.raises(ValueError, match="1-D"):
        model.forward_packed(torch.zeros(2, 4, dtype=torch.long), torch.arange(4).repeat(2, 1))


def full_token_logprobs(model, hidden, targets):
    """The unchunked reference: the whole ``[T, vocab]`` log_softmax at once, plain autograd."""
    logprobs = model.log_softmax(model.logits(hidden))
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, targets[:, None]).squeeze(-1), entropy


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("num_tokens", [23, 0])
def test_chunked_token_logprobs_and_entropy_are_the_full_ones(tiny_ckpt_untied, batch_invariant, num_tokens):
    """Bitwise in batch-invariant mode, where a row's logits do not depend on the chunk around it.
    In the default mode the BLAS may sum a row's logits in another order for another number of
    rows (it does on some CPUs), so chunking is only close there."""
    model = from_pretrained(tiny_ckpt_untied)
    if batch_invariant:
        to_batch_invariant(model)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(num_tokens, model.args.hidden_size, generator=gen)
    targets = torch.randint(0, model.args.vocab_size, (num_tokens,), generator=gen, dtype=torch.int32)
    with torch.no_grad():
        expected, expected_entropy = full_token_logprobs(model, hidden, targets.long())
    hidden.requires_grad_()
    same = torch.equal if batch_invariant else (lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-5))
    for chunk_size in (1, 5, 23, 64):
        for grad_enabled in (False, True):
            with torch.set_grad_enabled(grad_enabled):
                logprobs, entropy = model.token_logprobs_and_entropy(hidden, targets, chunk_size=chunk_size)
                only_logprobs = model.token_logprobs(hidden, targets, chunk_size=chunk_size)
            assert logprobs.dtype == entropy.dtype == torch.float32
            assert same(logprobs, expected) and same(entropy, expected_entropy)
            assert same(only_logprobs, expected)
            assert logprobs.requires_grad == grad_enabled and not entropy.requires_grad


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_ckpt_untied"])
def test_token_logprobs_gradients_equal_autograd_through_the_full_log_softmax(fixture, request):
    model = from_pretrained(request.getfixturevalue(fixture))
    _, input_ids, positions = random_docs([9, 14], model.args.vocab_size)
    targets = torch.roll(input_ids, -1)
    upstream = torch.randn(23, generator=torch.Generator().manual_seed(2))  # d loss / d logprobs

    def gradients(token_logprobs):
        model.zero_grad()
        hidden = model.forward_packed(input_ids, positions)
        hidden.retain_grad()
        (token_logprobs(hidden) * upstream).sum().backward()
        # Tied: embed_tokens.weight's gradient sums the embedding's and the LM head's.
        return {"hidden": hidden.grad, **{name: p.grad for name, p in model.named_parameters()}}

    expected = gradients(lambda hidden: full_token_logprobs(model, hidden, targets)[0])
    head = "model.embed_tokens.weight" if model.args.tie_word_embeddings else "lm_head.weight"
    for chunk_size in (5, 64):
        got = gradients(lambda hidden: model.token_logprobs_and_entropy(hidden, targets, chunk_size)[0])  # noqa: B023
        for name, grad in expected.items():
            assert grad.abs().max() > 0, name
            # Past the head, backprop through the layers amplifies fp32 rounding: measured, the
            # fp32 reference is itself 2e-6 from an fp64 one, and this code as close as it is.
            tolerance = 1e-6 if name in ("hidden", head) else 1e-5
            assert ((got[name] - grad).norm() / grad.norm()).item() < tolerance, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [23, 0])
def test_log_softmax_kernels_equal_autograd_through_the_fp32_log_softmax(dtype, num_tokens):
    """The head's kernels against ``logits.float().log_softmax(-1)`` of the same logits: both upcast
    before any arithmetic, so only the fp32 reductions' order differs. The softmax in the gradient
    is exp(logits - logsumexp), so a logsumexp a few fp32 ulps off (of ~10) is ~1e-6 relative
    there; in bf16 the gradients round those nearly equal values once, at most one ulp apart."""
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(num_tokens, 1000, generator=gen)).to(dtype).requires_grad_()
    targets = torch.randint(0, 1000, (num_tokens,), generator=gen)
    upstream = torch.randn(num_tokens, generator=gen)
    full = logits.float().log_softmax(-1)
    expected = full.gather(-1, targets[:, None]).squeeze(-1)
    (expected * upstream).sum().backward()
    kernels = LogSoftmax()
    with torch.no_grad():
        for with_entropy in (False, True):
            logprobs, logsumexp, entropy = kernels.at_targets(logits, targets, with_entropy)
            assert logprobs.dtype == logsumexp.dtype == torch.float32
            torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)
            torch.testing.assert_close(logsumexp, logits.float().logsumexp(-1), rtol=0, atol=1e-5)
            if with_entropy:
                torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1), rtol=0, atol=1e-5)
            else:
                assert entropy is None
        grad = kernels.grad_logits(logits, logsumexp, targets, upstream)
    assert grad.dtype == dtype
    rtol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5  # bf16's ulp is 2^-8 to 2^-7 relative
    torch.testing.assert_close(grad, logits.grad, rtol=rtol, atol=1e-7)


def test_bfloat16_token_logprobs_and_gradients_match_autograd_through_the_full_log_softmax(tiny_ckpt_untied):
    """The whole head in bf16, chunked or not, against autograd through one fp32 log_softmax of all
    the logits. Both round each gradient into bf16 (2^-9 relative) and the chunked weight
    gradient is also summed chunk by chunk into a bf16 tensor: one more such rounding per chunk."""
    model = from_pretrained(tiny_ckpt_untied, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, model.args.hidden_size, generator=gen).bfloat16().requires_grad_()
    targets = torch.randint(0, model.args.vocab_size, (23,), generator=gen)
    upstream = torch.randn(23, generator=gen)

    def run(token_logprobs):
        model.zero_grad()
        hidden.grad = None
        logprobs, entropy = token_logprobs()
        (logprobs * upstream).sum().backward()
        return logprobs.detach(), entropy.detach(), hidden.grad, model.lm_head.weight.grad

    def reference(chunk_size):  # the logits of the same chunks: a BLAS may round a row per chunk shape
        logits = torch.cat([model.logits(rows) for rows in hidden.split(chunk_size)])
        logprobs = logits.float().log_softmax(-1)
        return logprobs.gather(-1, targets[:, None]).squeeze(-1), -(logprobs.exp() * logprobs).sum(-1)

    for chunk_size in (5, 23, 64):
        expected = run(lambda: reference(chunk_size))  # noqa: B023
        got = run(lambda: model.token_logprobs_and_entropy(hidden, targets, chunk_size))  # noqa: B023
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-5)
        chunks = math.ceil(23 / chunk_size)
        assert relative_error(got[2].float(), expected[2].float()) < 2 ** -8
        assert relative_error(got[3].float(), expected[3].float()) < 2 ** -9 * (1 + chunks)


def test_token_logprobs_gradcheck_in_float64():
    """fp64 logits stay fp64 in the plain log-softmax's kernels, so gradcheck's precision holds."""
    args = ModelArgs(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=4, tie_word_embeddings=False)
    model = DecoderForCausalLM(args).double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.randn(16, 8, generator=gen))
    hidden = torch.randn(7, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 16, (7,), generator=gen)

    def logprobs(hidden, weight):  # weight is the LM head's: gradcheck perturbs it in place
        return model.token_logprobs_and_entropy(hidden, targets, chunk_size=3)[0]

    assert torch.autograd.gradcheck(logprobs, (hidden, model.lm_head.weight), atol=1e-8, rtol=1e-6)


def test_token_logprobs_of_no_tokens_have_zero_gradients(tiny_ckpt):
    model = from_pretrained(tiny_ckpt)
    hidden = torch.zeros(0, model.args.hidden_size, requires_grad=True)
    model.token_logprobs(hidden, torch.zeros(0, dtype=torch.long)).sum().backward()
    assert hidden.grad.shape == hidden.shape
    assert torch.equal(model.lm_head.weight.grad, torch.zeros_like(model.lm_head.weight))


def test_token_logprobs_rejects_bad_shapes(tiny_ckpt):
    model = from_pretrained(tiny_ckpt)
    hidden = torch.zeros(4, model.args.hidden_size)
    with pytest.raises(ValueError, match="target_ids"):
        model.token_logprobs(hidden, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        model.token_logprobs(hidden, torch.zeros(4, dtype=torch.long), chunk_size=0)


def meta_parameter_count(args):
    with torch.device("meta"):
        model = DecoderForCausalLM(args)
    counted = sum(p.numel() for p in model.parameters())  # the tied lm_head counted once
    assert counted == args.num_params()
    return counted


@pytest.mark.parametrize("size, billions, non_embedding_billions", [
    ("0.6b", 0.6, 0.44),  # Qwen3-0.6B model card: 0.6B parameters, 0.44B non-embedding
    ("1.7b", 1.7, 1.4),   # Qwen3-1.7B model card: 1.7B parameters, 1.4B non-embedding
])
def test_real_qwen3_shapes_without_allocating(size, billions, non_embedding_billions):
    args = size_args(size, vocab_size=1024)
    assert args.vocab_size == 151936 and args.tie_word_embeddings and args.torch_dtype == "bfloat16"
    counted = meta_parameter_count(args)
    assert round(counted / 1e9, 1) == billions
    non_embedding = counted - args.vocab_size * args.hidden_size
    assert round(non_embedding / 1e9, len(str(non_embedding_billions)) - 2) == non_embedding_billions


def test_real_qwen2_and_llama_shapes_without_allocating():
    qwen25 = size_args("0.5b", vocab_size=1024, family="qwen2")
    counted = meta_parameter_count(qwen25)  # q/k/v biases counted
    assert round(counted / 1e6) == 494  # Qwen2.5-0.5B on the HF hub: 494M parameters
    assert round((counted - qwen25.vocab_size * qwen25.hidden_size) / 1e9, 2) == 0.36  # model card: 0.36B non-embedding
    llama = size_args("1b", vocab_size=1024, family="llama")
    assert llama.rope_scaling is not None and llama.vocab_size == 128256
    assert round(meta_parameter_count(llama) / 1e9, 2) == 1.24  # Llama-3.2-1B on the HF hub: 1.24B parameters


def test_model_args_validation():
    good = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    ModelArgs(**good)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelArgs(**{**good, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="hidden_size"):
        ModelArgs(**{**good, "hidden_size": 0})
    with pytest.raises(ValueError, match="torch_dtype"):
        ModelArgs(**good, torch_dtype="int8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["varlen", "flash"])
def test_cuda_backends_match_sdpa(backend):
    from rlactors.attention.varlen import flash_attn_available

    if backend == "flash" and not flash_attn_available():
        pytest.skip("flash-attn not installed")
    lengths = [100, 1, 300, 57]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths), 8, 64, generator=gen).cuda().bfloat16().requires_grad_()
    k, v = (torch.randn(sum(lengths), 2, 64, generator=gen).cuda().bfloat16().requires_grad_() for _ in range(2))
    positions = torch.cat([torch.arange(n) for n in lengths]).cuda()
    out = VarlenAttention.from_positions(positions, backend=backend)(0, q, k, v)
    ref = reference_attention(q.float(), k.float(), v.float(), lengths)
    assert (out.float() - ref).abs().max().item() < 2e-2
    sdpa = VarlenAttention.from_positions(positions, backend="sdpa")(0, q, k, v)
    assert (out.float() - sdpa.float()).abs().max().item() < 2e-2
    out.float().square().sum().backward()
    assert q.grad is not None and k.grad.abs().max() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cuda_bf16_model_matches_hf(family, family_ckpt):
    from transformers import AutoModelForCausalLM

    ckpt = family_ckpt(family)
    ours = from_pretrained(ckpt, dtype=torch.bfloat16, device="cuda")
    ref = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16).cuda().eval()
    input_ids = torch.randint(0, ours.args.vocab_size, (3, 64), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        expected = ref(input_ids).logits.float()
        logits = ours.logits(ours.forward_packed(input_ids.flatten(), torch.arange(64, device="cuda").repeat(3)))
    assert (logits.float().view(3, 64, -1) - expected).abs().max().item() < 5e-2
