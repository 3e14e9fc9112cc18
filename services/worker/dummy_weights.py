"""`--load-format dummy`: deterministic weights of the right shapes, made from config.json alone.

For benchmarks of big shapes without downloads: every tensor is generated directly on the
target device in the run dtype (no host round trip: a 30B model's dummy weights take seconds on
a GPU), from a generator seeded by the tensor's name, so a tensor's values do not depend on
which other tensors exist or on the order they are made in.

Scales are chosen so a forward stays finite and routing behaves like a trained model's: it changes
with every token and a layer's input predicts the next layer's routing. With every weight at the
architectures' init scale (0.02) the attention output swamps the token embedding and averages over
the context, so the router sees almost the same input at every step and a benchmark's expert
cache hits far more than it would on a real checkpoint. Here the token embedding is strong
(N(0, 1)) and what each layer writes back into the residual stream is weak (o_proj, out_proj and
every down_proj ~ N(0, 0.002)); other linear weights ~ N(0, 0.02); RMSNorm weights and Gemma 4's multipliers
at the architecture's identity (ones, or zeros where the norm computes x * (1 + w)); Gated DeltaNet decay
terms like the reference init (A = exp(A_log) in [1, 16], dt_bias = 1); biases zero.

`routing_skew` s > 0 makes some experts popular, as in trained models: every token embedding
shares one direction u, and expert e's router row gains a component along u worth a logit bias
of -s * ln(1 + rank_e), the ranks a seeded permutation per layer (s = 0: uniform popularity)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch

from ferry.plan.costs import resident_weight_shapes
from ferry.plan.model_config import ModelSpec
from ferry.services.worker.models.weights import routed_expert_shapes

LINEAR_STD = 0.02
EMBED_STD = 1.0  # the token embedding dominates the residual stream: routing follows the token
OUTPUT_STD = 0.002  # what a layer writes back into the residual stream
OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
# Gemma 4's learned multipliers (the router's input scale, each expert's weight scale, each layer's output scale):
# at their identity, ones
IDENTITY_MULTIPLIERS = ("scale", "per_expert_scale", "layer_scalar")


def linear_std(name: str) -> float:
    """The standard deviation of a dummy linear weight (or the embedding) by its checkpoint name."""
    if name.endswith("embed_tokens.weight"):
        return EMBED_STD
    if name.endswith(OUTPUT_PROJECTIONS):
        return OUTPUT_STD
    return LINEAR_STD


def name_seed(name: str, seed: int) -> int:
    """A 63-bit seed from the tensor's name and the run's seed (stable across processes and machines)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def dummy_tensor(
    spec: ModelSpec,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    routing_skew: float = 0.0,
) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("A_log"):
        g = torch.Generator(device=device).manual_seed(name_seed(name, seed))
        a = torch.empty(shape, dtype=torch.float32, device=device).uniform_(1.0, 16.0, generator=g)
        return a.log_().to(dtype)
    if name.endswith("dt_bias"):
        return torch.ones(shape, dtype=dtype, device=device)
    if leaf == "bias":
        return torch.zeros(shape, dtype=dtype, device=device)
    if leaf in IDENTITY_MULTIPLIERS:
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith(("norm.weight", "layernorm.weight", "layernorm_1.weight", "layernorm_2.weight")):
        gated = ".linear_attn.norm." in name  # the gated norm multiplies by w itself
        if spec.zero_centered_norms and not gated:  # x * (1 + w): the identity weight is zero
            return torch.zeros(shape, dtype=dtype, device=device)
        return torch.ones(shape, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(name_seed(name, seed))
    t = torch.randn(shape, dtype=torch.float32, device=device, generator=g).mul_(linear_std(name))
    if routing_skew > 0:
        _skew(spec, name, t, device, seed, routing_skew)
    return t.to(dtype)


def is_router(spec: ModelSpec, name: str, shape) -> bool:
    """Whether checkpoint tensor `name` is a MoE block's router ([experts, hidden] under `.mlp.`, not a
    projection, or Gemma 4's `router.proj`): families name it differently (`mlp.gate.`, gpt-oss's `mlp.router.`)."""
    leaf_ok = ".mlp." in name and name.endswith(".weight") and not name.endswith("_proj.weight")
    leaf_ok = leaf_ok or name.endswith(".router.proj.weight")
    return leaf_ok and ".experts." not in name and tuple(shape) == (spec.num_experts, spec.hidden_size)


def _skew(spec: ModelSpec, name: str, t: torch.Tensor, device: torch.device, seed: int, s: float) -> None:
    """Add the shared direction to the embedding, and the popularity bias to the routers' rows."""
    h = spec.hidden_size
    g = torch.Generator(device=device).manual_seed(name_seed("routing direction", seed))
    u = torch.randn(h, device=device, generator=g)
    u /= u.norm()
    if name.endswith("embed_tokens.weight"):
        t += u * h**0.5  # as large as the token's own part: after the norm, x . u ~ sqrt(h / 2)
    elif is_router(spec, name, t.shape):
        g = torch.Generator(device=device).manual_seed(name_seed(name + " ranks", seed))
        rank = torch.randperm(t.shape[0], device=device, generator=g).float()
        bias = -s * torch.log1p(rank)
        t += bias[:, None] * u[None, :] / (h / 2) ** 0.5


def iter_dummy_tensors(
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device | str,
    routed_experts: bool,
    seed: int = 0,
    routing_skew: float = 0.0,
    progress: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The resident tensors (routed_experts=False) or the routed experts (True), like the checkpoint passes;
    `progress`: a tqdm bar on stderr (the caller decides: on a terminal only)."""
    from tqdm import tqdm

    device = torch.device(device)
    shapes = routed_expert_shapes(spec) if routed_experts else resident_weight_shapes(spec)
    desc = "random experts" if routed_experts else "random weights"
    for name, shape in tqdm(shapes.items(), desc=desc, unit="tensor", disable=not progress, leave=False):
        yield name, dummy_tensor(spec, name, shape, dtype, device, seed, routing_skew)


def iter_dummy_experts(
    spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, seed: int = 0, progress: bool = False
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(moe_layer, expert, gate, up, down) with the same values `iter_dummy_tensors` gives those names;
    `progress`: a tqdm bar on stderr."""
    from tqdm import tqdm

    device = torch.device(device)
    h, i = spec.hidden_size, spec.moe_intermediate_size
    with tqdm(
        total=len(spec.moe_layer_indices) * spec.num_experts,
        desc="random experts",
        unit="expert",
        disable=not progress,
        leave=False,
    ) as bar:
        for m, layer in enumerate(spec.moe_layer_indices):
            for e in range(spec.num_experts):
                p = f"model.layers.{layer}.mlp.experts.{e}."
                yield (
                    m,
                    e,
                    *(
                        dummy_tensor(spec, p + name, shape, dtype, device, seed)
                        for name, shape in (
                            ("gate_proj.weight", (i, h)),
                            ("up_proj.weight", (i, h)),
                            ("down_proj.weight", (h, i)),
                        )
                    ),
                )
                bar.update(1)
