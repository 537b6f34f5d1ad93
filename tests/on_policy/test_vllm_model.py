"""The trainer's side of true on-policy with vLLM, on CPU: where PagedFlashAttention puts each
packed token in vLLM's page layout, and the model's hook for the generator's own logprob kernel.
(vLLM itself is exercised on a GPU: tests/engines/test_vllm_true_on_policy.py.)"""

import torch

from rlactors.models.checkpoint import from_pretrained
from rlactors.on_policy.modules import InvariantLogSoftmax
from rlactors.on_policy.vllm_model import PAGE_SIZE, TRUE_ON_POLICY_ENGINE_ARGS, PagedFlashAttention


def test_each_document_is_laid_out_in_its_own_pages_as_vllm_reads_them():
    lengths = [5, 35, 1, 32, 17]
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0)
    attention = PagedFlashAttention(cu_seqlens, max(lengths))
    assert attention.block_table.dtype == torch.int32 and attention.num_pages == 1 + 3 + 1 + 2 + 2
    assert attention.block_table.tolist() == [[0, 0, 0], [1, 2, 3], [4, 4, 4], [5, 6, 6], [7, 8, 8]]
    # Write the packed keys (token index as value) and read each document back through its
    # block table, in vLLM's [pages, kv heads, PAGE_SIZE, 2 * head_dim] layout.
    tokens, heads, head_dim = sum(lengths), 2, 4
    k = torch.arange(tokens).float()[:, None, None].expand(tokens, heads, head_dim)
    cache = torch.zeros(attention.num_pages, heads, PAGE_SIZE, 2 * head_dim)
    cache[attention.page, :, attention.row] = torch.cat((k, -k), dim=-1)
    key_cache, value_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
    for doc, length in enumerate(lengths):
        pages = attention.block_table[doc].tolist()
        keys = torch.cat([key_cache[p] for p in pages])[:length, 1, 2]
        values = torch.cat([value_cache[p] for p in pages])[:length, 0, 3]
        start = int(cu_seqlens[doc])
        assert torch.equal(keys, torch.arange(start, start + length).float()) and torch.equal(values, -keys)


def test_the_engine_args_keep_vllm_from_reordering_sums():
    args = TRUE_ON_POLICY_ENGINE_ARGS
    # No Inductor fusions; CUDA graphs for decode, experts too (their grouped launch reads the
    # token counts on the GPU: tests/on_policy/test_batch_invariant.py captures such a layer).
    assert args["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert args["disable_cascade_attn"] and args["block_size"] == PAGE_SIZE


def test_a_token_logprob_kernel_replaces_log_softmax_and_gather_with_the_same_gradients(tiny_ckpt_untied):
    """The trainer computes a token's logprob with the generator's kernel when its model's
    log-softmax has one (``VLLMLogSoftmax``'s shape); the backward pass stays the default one."""
    model = from_pretrained(tiny_ckpt_untied)
    hidden = torch.randn(23, model.args.hidden_size, requires_grad=True)
    targets = torch.randint(0, model.args.vocab_size, (23,))
    expected, expected_entropy = model.token_logprobs_and_entropy(hidden, targets, chunk_size=5)
    (expected * torch.arange(23.0)).sum().backward()
    expected_grads = hidden.grad.clone(), model.lm_head.weight.grad.clone()
    hidden.grad = model.lm_head.weight.grad = None

    calls = []

    class KernelLogSoftmax(InvariantLogSoftmax):
        def target_logprobs(self, logits, chunk_targets):
            calls.append(len(chunk_targets))
            logits = logits.float()
            return (logits - logits.logsumexp(-1, keepdim=True)).gather(-1, chunk_targets[:, None])[:, 0], None

    model.log_softmax = KernelLogSoftmax()
    got, entropy = model.token_logprobs_and_entropy(hidden, targets, chunk_size=5)
    assert calls == [5, 5, 5, 5, 3]
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(entropy, expected_entropy)
    (got * torch.arange(23.0)).sum().backward()
    torch.testing.assert_close(hidden.grad, expected_grads[0])
    torch.testing.assert_close(model.lm_head.weight.grad, expected_grads[1])

