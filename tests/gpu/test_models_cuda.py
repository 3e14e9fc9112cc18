"""Tiny models of each architecture on CUDA in bf16, against transformers on the same weights.

Tolerance: bf16 keeps 8 significant bits, so every matmul, norm and residual add rounds at about
4e-3 relative; over a few layers the logits of any bf16 implementation drift from the exact
(float32) values by around 1e-2 of their scale, and two bf16 implementations with different
kernels (Triton attention, fla, fused vs per-expert GEMMs) drift differently. Worse, rounding
flips near-tied routing decisions, so single tokens can be off by O(1) for transformers itself
(measured on CPU: its bf16 max error reaches 0.47 of the logit scale on the tiny qwen3_next).
So we compare the MEAN absolute error against the float32 reference: ours must be within 2x
transformers' own bf16 mean error plus 1e-3 of the logit scale (measured on CPU bf16: ratio
1.0-1.2). A real bug (a wrong norm, gate, rotary or state) moves every logit by O(1)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from model_harness import PagedRunner  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT = [5, 17, 33, 2, 90, 41, 8, 8, 61, 12, 70, 3, 29]
STEPS = 16


def _teacher_forced(runner: PagedRunner, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Our logits that predict each continuation token, feeding the given tokens (not our argmax)."""
    rows = [runner.step([(1, prompt)])[0][-1]]
    for token in continuation[:-1]:
        rows.append(runner.step([(1, [token])], all_rows=False)[0][-1])
    return torch.stack(rows).cpu()


@pytest.mark.parametrize("arch,page_size", [("qwen3_moe", 16), ("qwen3_next", 1), ("qwen3_5_moe", 16)])
def test_bf16_on_cuda_tracks_transformers(arch, page_size, cuda_device):
    hf32, spec = tiny_model(arch, seed=31)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        hf16 = tiny_model(arch, seed=31)[0].to("cuda", torch.bfloat16)
        generated = hf16.generate(
            ids.cuda(), attention_mask=torch.ones_like(ids).cuda(), max_new_tokens=STEPS, min_new_tokens=STEPS,
            do_sample=False, pad_token_id=0, eos_token_id=None,
        )[0, len(PROMPT):].tolist()  # fmt: skip
        full = torch.tensor([PROMPT + generated])
        exact = hf32(full).logits[0, len(PROMPT) - 1 : -1].float()
        theirs = hf16(full.cuda()).logits[0, len(PROMPT) - 1 : -1].float().cpu()
    ours = _teacher_forced(PagedRunner(spec, hf16, page_size, dtype=torch.bfloat16, device=cuda_device), PROMPT, generated)

    scale = exact.abs().max().item()
    their_err = (theirs - exact).abs().mean().item()
    our_err = (ours - exact).abs().mean().item()
    assert torch.isfinite(ours).all()
    assert our_err <= 2 * their_err + 1e-3 * scale, f"mean error: ours {our_err:.3e}, transformers bf16 {their_err:.3e}"


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_float32_on_cuda_matches_transformers(arch, cuda_device):
    """float32 end to end on the GPU: only accumulation order (and fla's tf32 dots) differ."""
    hf, spec = tiny_model(arch, seed=32)
    with torch.no_grad():
        exact = hf(torch.tensor([PROMPT])).logits[0].float()
    ours = PagedRunner(spec, hf, 4, device=cuda_device).step([(1, PROMPT)])[0].cpu()
    assert (ours - exact).abs().max().item() <= 5e-3 * exact.abs().max().item()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe", "qwen3_next"])
def test_a_step_in_mixer_slices_on_cuda_matches_transformers(arch, cuda_device, monkeypatch):
    """A 300-token step whose token mixers run in slices of 128 (services/worker/mixer_slices.py): float32 on
    the GPU against transformers, and bf16 against the same step unsliced (the same kernels, per slice)."""
    from ferry.services.worker import forward_batch

    hf, spec = tiny_model(arch, seed=33)
    prompt = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        exact = hf(torch.tensor([prompt])).logits[0].float()
    monkeypatch.setattr(forward_batch, "MIXER_SLICE_TOKENS", 128)
    ours = PagedRunner(spec, hf, 16, device=cuda_device).step([(1, prompt)])[0].cpu()
    assert (ours - exact).abs().max().item() <= 5e-3 * exact.abs().max().item()
    hf16 = tiny_model(arch, seed=33)[0].to(torch.bfloat16)
    sliced = PagedRunner(spec, hf16, 16, dtype=torch.bfloat16, device=cuda_device).step([(1, prompt)])[0].cpu()
    monkeypatch.setattr(forward_batch, "MIXER_SLICE_TOKENS", 10_000)
    whole = PagedRunner(spec, hf16, 16, dtype=torch.bfloat16, device=cuda_device).step([(1, prompt)])[0].cpu()
    assert (sliced - whole).abs().mean().item() <= 1e-2 * whole.abs().max().item()
