"""The mixture-of-experts block of ``qwen3_moe`` models, with Hugging Face parameter names.

A sparse layer's MLP is ``SparseMoeBlock``: a router (``gate``), a softmax, the top ``k`` experts
per token (``route``), each chosen expert's SwiGLU MLP, and the outputs summed weighted by the
router's probabilities. The experts are held fused, as transformers 5 holds them
(``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``): dim 0 is the expert, so
FSDP shards by experts and expert parallelism (``rlactors.trainer.expert_parallel``) places whole
experts. Checkpoints hold one tensor per expert (``rlactors.models.checkpoint`` converts).
``RoutingReplay`` can force each token's experts (R3). Tokens are sorted by expert, one matmul
per expert (``grouped_linear``). Top-k is a stable sort and the weighted sum runs in rank order,
so neither depends on the batch (docs/ARCHITECTURE.md, "Model").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rlactors.models.args import ModelArgs


class SparseMoeBlock(nn.Module):
    """The mixture of experts' output for a ``[T, hidden]`` input."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.moe.num_experts_per_tok
        self.norm_topk_prob = args.moe.norm_topk_prob
        self.experts = Experts(args)
        self.gate = nn.Linear(args.hidden_size, args.moe.num_experts, bias=False)  # the router
        self.replay = RoutingReplay()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.route(self.gate(x).float().softmax(-1), x.dtype))

    def route(self, probs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(expert_ids, weights)`` of each token under the router's fp32 ``probs [T, E]``: its top
        ``k``, or the experts ``replay`` forces on it; the weights in ``dtype``."""
        weights, expert_ids = top_k_experts(probs, self.top_k, self.norm_topk_prob)
        weights, expert_ids = self.replay(probs, weights, expert_ids, self.norm_topk_prob)
        return expert_ids, weights.to(dtype)


def top_k_experts(probs: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, expert_ids)``, both ``[T, top_k]``: each token's ``top_k`` most probable
    experts under the router's fp32 ``probs [T, E]``, most probable first, and their
    probabilities (renormalized to sum to 1 with ``renormalize``). Equal probabilities go to the
    lower expert index, on any device."""
    probs, expert_ids = probs.sort(dim=-1, descending=True, stable=True)
    weights, expert_ids = probs[:, :top_k], expert_ids[:, :top_k]
    if renormalize:
        weights = weights / _sum_in_order(weights.unbind(-1))[:, None]
    return weights, expert_ids


class RoutingReplay(nn.Module):
    """Routing replay (R3): the experts another model (the generator) routed each token to, forced
    on this forward in place of the router's own top-k; their weights are this router's
    probabilities at those experts (renormalized as top-k's are). ``experts`` (int64 ``[T, k]``,
    a row of -1 where unknown: that token keeps its own top-k) is set for a forward by its caller
    (the trainer, which checks its shape); None replays nothing. A module, so hooks see the
    router's choice (input) and the experts used (output)."""

    experts: torch.Tensor | None = None

    def forward(self, probs: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self.experts is None:
            return weights, expert_ids
        known = (self.experts >= 0).all(-1, keepdim=True)
        expert_ids = torch.where(known, self.experts, expert_ids)
        weights = probs.gather(-1, expert_ids)
        if renormalize:
            weights = weights / _sum_in_order(weights.unbind(-1))[:, None]
        return weights, expert_ids


def _sum_in_order(terms) -> torch.Tensor:
    """``terms[0] + terms[1] + ...``, left to right: elementwise, so a row's sum never depends on
    the shape of the batch (a reduction kernel may pick its order by shape)."""
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs in two fused parameters: ``gate_up_proj [E, 2I, H]`` (each
    expert's gate rows, then its up rows) and ``down_proj [E, H, I]``.

    With ``expert_parallel`` set (``rlactors.trainer.expert_parallel``), this rank holds some of
    the experts and the rows grouped by expert go to the ranks that hold theirs and come back."""

    expert_parallel: Callable[[Experts, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        moe = args.moe
        self.num_experts = moe.num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.moe_intermediate_size, args.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, args.hidden_size, moe.moe_intermediate_size))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[t, j] * expert[expert_ids[t, j]](x[t])`` for every token ``t``, the
        sum over ``j`` in order."""
        tokens, top_k = expert_ids.shape
        slots = expert_ids.reshape(-1)  # slot t * top_k + j: token t's j-th expert
        order = slots.argsort(stable=True)  # the slots grouped by expert, each group in token order
        # Not bincount: on CUDA it reads the largest id on the host to size its output.
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, slots, torch.ones_like(slots))
        if self.expert_parallel is None:
            out = self.mlp(x[order // top_k], counts, self.gate_up_proj, self.down_proj)
        else:
            out = self.expert_parallel(self, x[order // top_k], counts)
        out = out[order.argsort()].view(tokens, top_k, -1)  # back to slot order
        return _sum_in_order([out[:, j] * weights[:, j, None] for j in range(top_k)])

    def mlp(self, rows: torch.Tensor, counts: torch.Tensor, gate_up_proj: torch.Tensor,
            down_proj: torch.Tensor) -> torch.Tensor:
        """The SwiGLU of ``rows`` grouped by expert, ``counts[e]`` rows for the ``e``-th expert of
        ``gate_up_proj`` and ``down_proj``."""
        gate, up = self.grouped_linear(rows, gate_up_proj, counts).chunk(2, dim=-1)
        return self.grouped_linear(self.activation(gate, up), down_proj, counts)

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, weight, counts)

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x``'s rows in groups, ``counts[e]`` rows for expert ``e`` in expert order, each group
    times its expert's ``weight[e].T`` (``weight [E, out, in]``)."""
    if x.is_cuda and x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=counts.cumsum(0).to(torch.int32))
    return linear_per_expert(x, weight, counts, lambda rows, w: rows @ w.T)


def linear_per_expert(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                      matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``grouped_linear`` as one ``matmul(rows, weight[e])`` per expert that got rows."""
    groups = [(e, rows) for e, rows in enumerate(x.split(counts.tolist())) if rows.shape[0]]
    if not groups:
        return x.new_empty(0, weight.shape[1])
    return torch.cat([matmul(rows, weight[e]) for e, rows in groups])


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """The Switch Transformer's auxiliary loss, averaged over the sparse layers whose router
    logits ``[T, E]`` are given: ``E * sum_e f_e * P_e``, ``f_e`` the share of the tokens' top-k
    slots that go to expert ``e`` and ``P_e`` its mean router probability; 1 when the load is even."""
    losses = []
    for logits in router_logits:
        probs = logits.float().softmax(-1)
        num_experts = probs.shape[-1]
        chosen = probs.topk(top_k, dim=-1).indices.reshape(-1)
        share = torch.bincount(chosen, minlength=num_experts).float() / chosen.numel()
        losses.append(num_experts * (share * probs.mean(0)).sum())
    return torch.stack(losses).mean()
