"""The feed-forward blocks: a dense SwiGLU MLP (mlp_only layers, shared experts) and the routed
MoE block, which only reaches its routed experts through the ExpertStore.

At one decode token a MoE block's cost on the GPU is its launches, not its bytes, so on the Triton
path (CUDA) the block is a few fused launches:

    router + shared gate GEMV ─▶ router kernel (softmax/top-k/renormalise, sigmoid of the gate)
      ─▶ routed experts (the store) ─▶ shared expert (the pair kernels, as one more expert) ─▶ combine

(past the pair kernels' 64 rows, the shared expert is a gate/up GEMV, SiLU-and-mul and a down GEMV).

For that, weights the checkpoint stores apart are one parameter here: the router [E, hidden] and
the shared expert's gate [1, hidden] are the rows of one [E + 1, hidden] weight, gate_proj and
up_proj one [2I, hidden]. A module says which checkpoint tensors are which rows of which of its
parameters (`checkpoint_rows`), and the loader (models/weights.py) writes each into its row view; no
tensor is held twice. Elsewhere (CPU) the same code as before runs on row views of the fused
weights, one linear each: it is the reference twin, and matches transformers' sequence op for op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferry.kernels.dense_gemv import dense_linear
from ferry.kernels.dispatch import use_triton
from ferry.kernels.expert_pair_gemv import PAIR_KERNEL_MAX_PAIRS, expert_pair_rows_triton, use_pair_kernel
from ferry.kernels.expert_rows_sum import ExpertRows
from ferry.kernels.moe_combine import moe_combine, moe_combine_reference, silu_mul_triton
from ferry.kernels.router_topk import SigmoidRouting, router_topk_triton
from ferry.kernels.router_topk_reference import router_topk_reference, sigmoid_topk_reference
from ferry.plan.model_config import ModelSpec
from ferry.plan.model_spec import GELU_TANH, SILU
from ferry.services.worker.offload.stores.expert_store import ExpertStore


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate_proj and up_proj stacked in `gate_up_proj` [2I, hidden]; with
    `activation` GELU_TANH, down(gelu_tanh(gate(x)) * up(x)) (Gemma's), whose fused kernels are SiLU's only, so
    it takes the torch composition on every device."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device=None, activation: str = SILU):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.intermediate = intermediate
        self.gelu = activation == GELU_TANH
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, **kw)
        self.down_proj = nn.Linear(intermediate, hidden, **kw)
        self._single_expert: tuple[torch.Tensor, torch.Tensor] | None = None  # see forward_rows
        # {parameter: {checkpoint tensor: its rows}}, names relative to this module (models/weights.py)
        i = intermediate
        self.checkpoint_rows = {
            "gate_up_proj.weight": {"gate_proj.weight": slice(0, i), "up_proj.weight": slice(i, 2 * i)}
        }

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        if use_triton(x) and not self.gelu:  # one GEMV for gate and up, one kernel for SiLU and the product
            return dense_linear(silu_mul_triton(dense_linear(x, self.gate_up_proj.weight)), self.down_proj.weight)
        return self.reference(x)

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` for the MoE block's combine on the Triton path: float32 [T, H] holding the bf16
        values. A decode step's few rows go through the routed experts' pair kernels, as one expert
        whose slot is this MLP's weights (gate/up with SiLU fused, then down): at one token cuBLAS
        took 13 µs for the stacked gate/up GEMV alone, the pair kernels ~5 for the whole MLP;
        the roundings are the same (projections, SiLU and
        product, down, each rounded to the dtype). Larger steps take `forward`."""
        t = x.shape[0]
        if not use_pair_kernel(t) or not x.is_contiguous() or self.gelu:
            return self.forward(x).float()
        if self._single_expert is None or self._single_expert[0].device != x.device:
            # the pair kernel's slot (0) and routing weight (1) of every row, made once: a step
            # captured in a CUDA graph reads them at fixed addresses
            n = PAIR_KERNEL_MAX_PAIRS
            self._single_expert = (
                torch.zeros(n, 1, dtype=torch.int64, device=x.device),
                torch.ones(n, 1, dtype=x.dtype, device=x.device),
            )
        slots, weights = self._single_expert
        rows = torch.empty(t, 1, x.shape[1], dtype=torch.float32, device=x.device)
        expert_pair_rows_triton(
            x, slots[:t], weights[:t], self.gate_up_proj.weight[None], self.down_proj.weight[None], rows
        )
        return rows.view(t, x.shape[1])

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        w, i = self.gate_up_proj.weight, self.intermediate
        gate = F.linear(x, w[:i])
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * F.linear(x, w[i:]))


class TopKRouter(nn.Module):
    """softmax over all experts (float32), keep the top k, optionally renormalise them to sum to 1
    (kernels/router_topk_reference.py says how); with a shared expert's gate, also the sigmoid of that gate.

    Or, where `spec.router_scoring` is "sigmoid", the sigmoid router: logits in float32 (as transformers
    computes them), the top k chosen by score + `e_score_correction_bias` within the best expert groups,
    weighted by the unbiased scores, renormalised, scaled (the same router kernel on the Triton path, its
    twin `sigmoid_topk_reference` elsewhere).

    `logit_weight` holds every row the block computes from x before its experts: the E router rows,
    then the shared expert's gate row when there is one, and `logit_bias` their biases where the router
    has them (`spec.router_bias`, gpt-oss; the gate's stays zero). `weight` is the router's [E, hidden]
    view (what the offload store's next-layer prediction applies), `bias` its biases or None,
    `shared_gate_weight` the gate's."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device=None, shared_gate: bool = False):
        super().__init__()
        self.num_experts = spec.num_experts
        self.top_k = spec.num_experts_per_tok
        self.norm_topk_prob = spec.norm_topk_prob
        self.has_shared_gate = shared_gate
        self.sigmoid = spec.router_scoring == "sigmoid"
        self.groups, self.topk_groups = spec.router_groups, spec.router_topk_groups
        self.routed_scaling_factor = spec.routed_scaling_factor
        rows = spec.num_experts + (1 if shared_gate else 0)
        self.logit_weight = nn.Parameter(
            torch.zeros(rows, spec.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.logit_bias = None
        if spec.router_bias:
            self.logit_bias = nn.Parameter(torch.zeros(rows, dtype=dtype, device=device), requires_grad=False)
        self.e_score_correction_bias = None
        if spec.router_score_bias:  # float32, as the checkpoints store it: it decides between close scores
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(spec.num_experts, dtype=torch.float32, device=device), requires_grad=False
            )

    @property
    def weight(self) -> torch.Tensor:
        return self.logit_weight[: self.num_experts]

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.logit_bias is None else self.logit_bias[: self.num_experts]

    @property
    def shared_gate_weight(self) -> torch.Tensor | None:
        return self.logit_weight[self.num_experts :] if self.has_shared_gate else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(ids int64 [T, k], weights [T, k], sigmoid(shared gate logit) [T, 1] or None), x's dtype."""
        if not use_triton(x):
            return self.reference(x)
        if self.sigmoid:  # float32 logits, one kernel for the rest
            routing = SigmoidRouting(
                self.e_score_correction_bias, self.groups, self.topk_groups, self.routed_scaling_factor, x.dtype
            )
            logits = F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
            ids, weights, _ = router_topk_triton(
                logits, self.top_k, self.norm_topk_prob, self.num_experts, None, routing
            )
            shared = torch.sigmoid(F.linear(x, self.shared_gate_weight)) if self.has_shared_gate else None
            return ids, weights, shared
        # one GEMV for the router and the shared gate, one kernel for the rest
        logits = dense_linear(x, self.logit_weight, self.logit_bias)
        return router_topk_triton(logits, self.top_k, self.norm_topk_prob, self.num_experts)

    def reference(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self.sigmoid:
            ids, weights = sigmoid_topk_reference(
                F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float()),
                self.top_k,
                self.norm_topk_prob,
                self.e_score_correction_bias,
                self.groups,
                self.topk_groups,
                self.routed_scaling_factor,
                x.dtype,
            )
        else:
            ids, weights, _ = router_topk_reference(
                F.linear(x, self.weight, self.bias), self.top_k, self.norm_topk_prob, self.num_experts
            )
        shared = torch.sigmoid(F.linear(x, self.shared_gate_weight)) if self.has_shared_gate else None
        return ids, weights, shared


class SparseMoeBlock(nn.Module):
    def __init__(self, spec: ModelSpec, moe_layer: int, experts: ExpertStore, dtype: torch.dtype, device=None):
        super().__init__()
        self.moe_layer = moe_layer  # index of this layer among the MoE layers: the store's key
        shared = spec.shared_expert_intermediate_size > 0
        gated = shared and spec.shared_expert_gate  # else the shared expert's output is added as it is
        self.gate = TopKRouter(spec, dtype, device, shared_gate=gated)
        # a plain reference, never a registered submodule: the store's slots are not this model's parameters
        object.__setattr__(self, "experts", experts)
        self.shared_expert = None
        e = spec.num_experts
        rows = {"gate.weight": slice(0, e)}
        if shared:
            self.shared_expert = DenseMLP(spec.hidden_size, spec.shared_expert_intermediate_size, dtype, device)
        if gated:
            rows["shared_expert_gate.weight"] = slice(e, e + 1)
        self.checkpoint_rows = {"gate.logit_weight": rows}  # see DenseMLP
        if spec.router_bias:
            self.checkpoint_rows["gate.logit_bias"] = {"gate.bias": slice(0, e)}

    def forward(self, x: torch.Tensor, ctx=None, summed: bool = True) -> torch.Tensor | ExpertRows:
        """`ctx` (the step's StepContext) tells the store how many rows are real (a CUDA graph's
        batch is padded to its size). `summed=False` (the decoder layer, whose next RMSNorm sums
        them): a block without a shared expert may return the store's unsummed rows. With one, the
        combine sums them (kernels/expert_rows_sum.py)."""
        ids, weights, shared_gate = self.gate(x)
        n_rows = ctx.batch.real_tokens if ctx else None
        shared = self.shared_expert is not None
        out = self.experts.forward(self.moe_layer, x, ids, weights, n_rows=n_rows, summed=not shared and summed)
        if not shared:
            return out
        if shared_gate is None:  # an ungated shared expert: the combine's gate is 1, which scales exactly
            shared_gate = x.new_ones(x.shape[0], 1)
        if use_triton(x):
            return moe_combine(out, shared_gate, self.shared_expert.forward_rows(x))
        return moe_combine(out, shared_gate, self.shared_expert(x))

    def reference(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        """The plain-torch block whatever the device (the store computes the routed experts as it
        always does): what the fused path is compared with on a GPU."""
        ids, weights, shared_gate = self.gate.reference(x)
        out = self.experts.forward(self.moe_layer, x, ids, weights, n_rows=ctx.batch.real_tokens if ctx else None)
        if self.shared_expert is None:
            return out
        if shared_gate is None:
            shared_gate = x.new_ones(x.shape[0], 1)
        return moe_combine_reference(out, shared_gate, self.shared_expert.reference(x))
