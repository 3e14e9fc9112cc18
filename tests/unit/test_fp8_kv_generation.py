"""--kv-cache-dtype fp8 end to end on CPU: the tiny models' logprobs with an fp8 KV pool against the same model with
a bf16 one (README, "fp8 KV cache": the stated tolerance), the pool's isolation with fp8 rows and scales, and
`ferry generate --kv-cache-dtype fp8` through the boot, the plan and the executor."""

from __future__ import annotations

import pytest
import torch
from model_harness import PagedRunner
from test_generate_e2e import ferry_generate
from tiny_models import tiny_model

# The README's tolerance: over a 20-token prompt's last position and 28 teacher-forced decode steps, the
# logprob of the token bf16 KV ranks first moves by at most this (nats) with fp8 KV. Measured 0.02-0.05 on
# these models; bf16 itself moves the whole distribution by 0.04-0.9 from float32 on them.
TOP_LOGPROB_TOLERANCE = 0.1
ARCHS = ["qwen3_moe", "qwen3_next", "qwen3_5_moe"]


def _teacher_forced_logprobs(spec, hf, kv_cache_dtype: str, sequence: list[int], prompt_len: int) -> torch.Tensor:
    """log-softmax of every step's logits: the prompt in one step, then the rest of `sequence` a token a step."""
    runner = PagedRunner(spec, hf, 4, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype)
    outs = runner.step([(1, sequence[:prompt_len])])
    for token in sequence[prompt_len:]:
        outs += runner.step([(1, [token])])
    return torch.log_softmax(torch.cat(outs).float(), dim=-1)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_kv_logprobs_are_within_the_stated_tolerance_of_bf16_kv(arch):
    hf, spec = tiny_model(arch, seed=3)
    sequence = torch.randint(0, 96, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    bf16 = _teacher_forced_logprobs(spec, hf, "auto", sequence, 20)[19:]  # the prompt's last position on
    fp8 = _teacher_forced_logprobs(spec, hf, "fp8", sequence, 20)[19:]
    assert bf16.shape == fp8.shape == (29, spec.vocab_size) and torch.isfinite(fp8).all()
    top = bf16.argmax(dim=-1, keepdim=True)
    moved = (fp8.gather(1, top) - bf16.gather(1, top)).abs()
    assert moved.max() <= TOP_LOGPROB_TOLERANCE, f"top-token logprob moved by {moved.max():.4f}"
    assert moved.max() > 0, "fp8 KV changed nothing: the pool was not quantized"


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_poisoned_fp8_pool_changes_nothing_and_stays_poisoned_outside_owned(arch):
    """NaN in every value and scale of the pool: a request that read a row or scale it did not write would
    turn its logits NaN, a write outside its pages would leave a number where nobody owns one."""
    hf, spec = tiny_model(arch, seed=11)
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 12)]

    def run(runner):
        outs = runner.step([(1, prompts[0]), (2, prompts[1][:5])])
        outs += runner.step([(1, [3]), (2, prompts[1][5:])])
        return outs + runner.step([(1, [4]), (2, [5])])

    clean = run(PagedRunner(spec, hf, 4, dtype=torch.bfloat16, num_pages=40, kv_cache_dtype="fp8"))
    runner = PagedRunner(spec, hf, 4, dtype=torch.bfloat16, num_pages=40, kv_cache_dtype="fp8")
    runner.poison()
    for a, b in zip(clean, run(runner)):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    pages, _ = runner.owned()
    kv = runner.pools.kv
    for page in range(kv.kv.shape[2]):
        if page not in pages:  # the sentinel page 0 too
            assert torch.isnan(kv.kv[:, :, page].float()).all() and torch.isnan(kv.scale[:, :, page]).all(), page
    owned = sorted(pages)
    assert not torch.isnan(kv.scale[:, :, owned[0], 0]).any()


def test_ferry_generate_with_fp8_kv(tiny_models, capsys):
    """Through the boot (the plan priced with fp8 KV, the pools allocated exactly as priced), the executor and
    the sampler: the first token's logprob, after a prefill that read every prompt position back from the fp8
    pool, within the tolerance of bf16 KV's."""
    args = ("--prompt-ids", "5,6,7,8,9,10,11,12,13,14,15", "--max-tokens", "8", "--ignore-eos", "--dtype", "bfloat16")
    bf16 = ferry_generate(capsys, tiny_models["qwen3_5_moe"], *args)
    fp8 = ferry_generate(capsys, tiny_models["qwen3_5_moe"], *args, "--kv-cache-dtype", "fp8")
    kv = fp8["plan"]["kv"]
    assert (kv["cache_dtype"], kv["value_dtype"]) == ("fp8", "float8_e4m3fn")
    assert kv["bytes_per_token"] < bf16["plan"]["kv"]["bytes_per_token"] and kv["tokens"] > bf16["plan"]["kv"]["tokens"]
    assert len(fp8["token_ids"]) == 8 and all(lp <= 0 for lp in fp8["logprobs"])
    assert fp8["token_ids"][0] == bf16["token_ids"][0]
    assert abs(fp8["logprobs"][0] - bf16["logprobs"][0]) <= TOP_LOGPROB_TOLERANCE
