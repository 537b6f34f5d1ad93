"""True on-policy: the generator's logprob of a token equals the trainer's bit for bit. Everything
the mode runs lives here, and the plain model (``rlactors.models``) knows nothing of it:

- ``sides``: ``sides(true_on_policy, generator_engine, device)``, the one place that picks what
  the trainer and the generator run;
- ``modules``: the conversion of the plain decoder (``to_batch_invariant``, a module swap);
- ``ops``, ``ops_triton``: the batch-invariant ops (linear, RMSNorm, SiLU, RoPE, log-softmax) and
  their Triton kernels on CUDA;
- ``cpu_kernels`` (``cpu_kernels.c``): the fixed-order C matmul and attention on CPU;
- ``attention``, ``attention_triton``: batch-invariant attention (``attend``, ``AttentionPlan``),
  the trainer's ``BatchInvariantAttention`` and the native engine's
  ``BatchInvariantPagedAttention``; its Triton kernel;
- ``vllm_model``: our model inside vLLM (``VLLMCausalLM``) and the trainer's copies of vLLM's
  attention (``PagedFlashAttention``) and sampled-token logprob kernel.
"""
