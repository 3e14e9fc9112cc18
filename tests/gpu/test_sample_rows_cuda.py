"""The one-pass sampling kernels on CUDA, at a real vocabulary (Qwen3.6's 248,320 tokens), against their
torch twin, and the sampler end to end: greedy rows the argmax, seeded rows the same token whatever
their batch."""

import numpy as np
import torch

from ferry.kernels.sample_rows import sample_rows, sample_rows_reference
from ferry.services.worker.sampler import Sampler
from ferry.shared.sampling import SamplingParams
from ferry.shared.step import NewRequest

VOCAB = 248_320


def test_kernels_equal_the_twin_at_full_vocabulary(cuda_device):
    g = torch.Generator(device=cuda_device).manual_seed(0)
    logits = torch.randn(5, VOCAB, device=cuda_device, generator=g) * 5
    logits[3, 1000:] = float("-inf")  # a filtered row
    inv_t = torch.tensor([1.0, 1.25, 1.0, 2.0, 1.0], device=cuda_device)
    noise = torch.empty(3, VOCAB, device=cuda_device).exponential_(generator=g)
    noise_rows = torch.tensor([-1, 0, -1, 1, 2], device=cuda_device)
    tokens, logprobs = sample_rows(logits, inv_t, noise, noise_rows)
    ref_tokens, ref_logprobs = sample_rows_reference(logits, inv_t, noise, noise_rows)
    assert torch.equal(tokens, ref_tokens)
    assert torch.allclose(logprobs, ref_logprobs, atol=1e-4)
    assert int(tokens[3]) < 1000


def test_a_row_of_nan_draws_an_id_of_the_vocabulary(cuda_device):
    """Compiled, as under the interpreter (tests/unit/test_kernel_sample_rows.py): a NaN row (a padding row whose
    state overflowed) and an infinite row at a 0 inverse temperature draw token 0, a NaN among finite logits is
    never drawn; the MTP head embeds these samples in the decode graph, where an id past the vocabulary stops the
    device."""
    logits = torch.randn(3, VOCAB, device=cuda_device)
    logits[0] = float("nan")
    logits[1] = float("inf")
    logits[2, [5, 200_000]] = float("nan")
    inv_t = torch.tensor([1.0, 0.0, 1.0], device=cuda_device)
    noise_rows = torch.full((3,), -1, dtype=torch.int64, device=cuda_device)
    tokens, _ = sample_rows(logits, inv_t, None, noise_rows)
    assert torch.equal(tokens, sample_rows_reference(logits, inv_t, None, noise_rows)[0])
    assert tokens[:2].tolist() == [0, 0] and 0 <= int(tokens[2]) < VOCAB
    assert not bool(logits[2, tokens[2]].isnan())


def test_seeded_rows_do_not_depend_on_their_batch(cuda_device):
    sampler = Sampler(VOCAB, cuda_device, seed=0)
    params = {
        1: SamplingParams(temperature=0.8, seed=7),
        2: SamplingParams(temperature=0.0),
        3: SamplingParams(temperature=1.0, top_p=0.9),
    }
    for rid, p in params.items():
        sampler.add_request(NewRequest(req_id=rid, prompt_token_ids=np.array([1, 2], dtype=np.int32), sampling=p))
    logits = torch.randn(3, VOCAB, device=cuda_device) * 3
    tokens, _ = sampler.choose([1, 2, 3], logits)
    assert int(tokens[1]) == int(logits[1].argmax())
    alone = Sampler(VOCAB, cuda_device, seed=123)
    alone.add_request(NewRequest(req_id=1, prompt_token_ids=np.array([1, 2], dtype=np.int32), sampling=params[1]))
    assert int(alone.choose([1], logits[:1])[0][0]) == int(tokens[0])
