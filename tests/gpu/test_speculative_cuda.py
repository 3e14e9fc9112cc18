"""Speculative decoding on CUDA (shared/speculation.py): the scheduler and the real worker's executor in one process,
as tests/unit/test_speculative_decoding.py and test_mtp_drafting.py run them on CPU, here with decode graphs for the
plain rows and the drafting rows eager. Prompt lookup (ngram) on both tiny architectures and the MTP head on a tiny
Qwen3.5 MoE and GLM-4 MoE with their MTP layers (the plain rows' graphs writing the head's K/V): rows are sent with
drafts (prompt lookup told the answer with one draft spoiled in turn, as test_speculative_decoding.py's knowing
drafter does: a random model's text seldom repeats), and greedy decoding gives the tokens of speculation off. A
verify row's positions go through other kernels than one-token decode rows (a short prefill's), so where the two
differ it must be at a near tie of speculation off's two most likely tokens (its top-2 logprobs, asked of the same
requests), never a real difference."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from ferry.services.make_tiny_model import make_tiny_model
from ferry.services.scheduler import batcher as batcher_module
from ferry.shared.sampling import SamplingParams
from tests.helpers import cuda_test_budget
from tests.unit.test_speculative_decoding import MAX_TOKENS, PROMPTS, boot, generate, knowing_drafter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NEAR_TIE = 1e-3  # top-2 logprobs this close may take either order under another kernel's float32 sums
# the GPU computes every expert: a boot calibration skewed by other test processes could hand misses to the host
CUDA = ("--device", "cuda", "--gpu-memory", cuda_test_budget(768 * 2**20), "--expert-backend", "gpu")


def _greedy(logprobs: int | None = None) -> list:
    sampling = SamplingParams(temperature=0, logprobs=logprobs)
    return [(p, sampling, n) for p, n in zip(PROMPTS, MAX_TOKENS)]


def _check_speculation_keeps_the_tokens(executor, plan, method: str, monkeypatch):
    """Greedy speculation gives speculation off's tokens (but at near ties); returns the scheduler of the run with
    speculation."""
    off, _ = generate(executor, plan, _greedy(logprobs=2))  # logprobs: plain rows, and each position's top-2
    margins = {}
    for rid, entries in generate.logprobs.items():
        top = np.concatenate([e.top_logprobs for e in entries])
        margins[rid] = top[:, 0] - top[:, 1]
    if method == "ngram":  # a random model's text seldom repeats: prompt lookup told the answer, a draft spoiled
        reference = {tuple(p): tokens for p, (tokens, _) in zip(PROMPTS, off)}
        monkeypatch.setattr(batcher_module, "propose_ngram", knowing_drafter(reference, executor.spec.vocab_size))
    on, sched = generate(executor, plan, _greedy(), method, k=4)
    assert sched.draft_rows > 0 and sched.drafted_tokens > 0, "no row was sent with drafts"
    if method == "ngram":  # rows kept every draft, some and none
        assert 0 < sched.accepted_drafts < sched.drafted_tokens
    for rid, ((want, _), (got, _)) in enumerate(zip(off, on), start=1):
        same = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if same is not None:
            assert margins[rid][same] < NEAR_TIE, (method, rid, same, float(margins[rid][same]), want, got)
        else:
            assert len(got) == len(want), (method, rid, want, got)
    return sched


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_ngram_drafts_keep_the_greedy_tokens_through_graphs(tiny_models, arch, monkeypatch):
    executor, plan = boot(tiny_models[arch], *CUDA)
    # plain rows replay decode graphs, drafting rows run eagerly; in float32 the hybrid's Gated DeltaNet takes its
    # reference twin, which waits for the device, so it decodes eagerly throughout (test_device_decode_cuda.py)
    assert (executor.graphs is not None) == (arch == "qwen3_moe")
    _check_speculation_keeps_the_tokens(executor, plan, "ngram", monkeypatch)
    del executor
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "glm4_moe"])
def test_mtp_drafts_keep_the_greedy_tokens(tmp_path, arch, monkeypatch):
    model = make_tiny_model(tmp_path / arch, arch, seed=0, mtp=True)
    executor, plan = boot(model, *CUDA, "--speculative-method", "mtp")
    # plain rows replay decode graphs that write the head's K/V (the float32 hybrid decodes eagerly, as above)
    assert (executor.graphs is not None) == (arch == "glm4_moe")
    sched = _check_speculation_keeps_the_tokens(executor, plan, "mtp", monkeypatch)
    # the controller priced with what the worker timed on the device: graph replays, chain positions
    assert (sched.draft_length.decode_step_s is not None) == (arch == "glm4_moe")
    assert 0 < sched.draft_length.chain_position_s < 1.0
    del executor
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("arch, method", [("qwen3_moe", "ngram"), ("glm4_moe", "mtp")])
def test_single_stream_verify_steps_replay_their_graphs_and_keep_the_tokens(
    tmp_path, tiny_models, arch, method, monkeypatch
):
    """One request at a time, every verify step one row: it replays a verify graph (and with mtp the chain replays
    the chain graphs), and greedy decoding gives speculation off's tokens but at near ties. Graphs == eager: the
    same requests with --enforce-eager give the same tokens."""
    model = tiny_models[arch] if method == "ngram" else make_tiny_model(tmp_path / arch, arch, seed=0, mtp=True)
    flags = ("--speculative-method", method)
    executor, plan = boot(model, *CUDA, *flags)
    graphs = executor.graphs
    assert graphs is not None and graphs.verify is not None and graphs.verify.graphs
    assert (graphs.chains is not None and bool(graphs.chains.chains)) == (method == "mtp")
    replays = {"verify": 0, "chain": 0}
    for kind, owner in (("verify", graphs.verify), ("chain", graphs.chains)):
        if owner is not None:
            run = owner.run
            monkeypatch.setattr(
                owner,
                "run",
                lambda *a, _run=run, _kind=kind: replays.__setitem__(_kind, replays[_kind] + 1) or _run(*a),
            )
    off_tokens, on_tokens, margins = [], [], []
    reference = {}
    for prompt, n in zip(PROMPTS, MAX_TOKENS):
        (off,), _ = generate(executor, plan, [(prompt, SamplingParams(temperature=0, logprobs=2), n)])
        entries = next(iter(generate.logprobs.values()))
        top = np.concatenate([e.top_logprobs for e in entries])
        off_tokens.append(off[0])
        margins.append(top[:, 0] - top[:, 1])
        reference[tuple(prompt)] = off[0]
    if method == "ngram":
        monkeypatch.setattr(batcher_module, "propose_ngram", knowing_drafter(reference, executor.spec.vocab_size))
    timed = []  # the verify steps' verify_step_s: timed where a graph replayed them, 0 where they ran eagerly
    finish = executor.finish

    def finish_timed(launched):
        out = finish(launched)
        if out.accepted_drafts is not None:
            timed.append(out.verify_step_s)
        return out

    monkeypatch.setattr(executor, "finish", finish_timed)
    drafted = 0
    for prompt, n in zip(PROMPTS, MAX_TOKENS):
        (on,), sched = generate(executor, plan, [(prompt, SamplingParams(temperature=0), n)], method, k=4)
        on_tokens.append(on[0])
        drafted += sched.drafted_tokens
    assert drafted > 0 and replays["verify"] > 0 and (replays["chain"] > 0) == (method == "mtp")
    assert sum(s > 0 for s in timed) == replays["verify"] and all(s >= 0 for s in timed)
    for want, got, margin in zip(off_tokens, on_tokens, margins):
        first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if first is not None:
            assert margin[first] < NEAR_TIE, (arch, first, float(margin[first]), want, got)
        else:
            assert len(got) == len(want)
    del executor, graphs
    gc.collect()
    torch.cuda.empty_cache()
    eager, plan = boot(model, *CUDA, *flags, "--enforce-eager")
    assert eager.graphs is None
    for prompt, n, got in zip(PROMPTS, MAX_TOKENS, on_tokens):
        (again,), _ = generate(eager, plan, [(prompt, SamplingParams(temperature=0), n)], method, k=4)
        first = next((i for i, (a, b) in enumerate(zip(got, again[0])) if a != b), None)
        assert first is None or margins[PROMPTS.index(prompt)][first] < NEAR_TIE, (arch, first)
    del eager
    gc.collect()
    torch.cuda.empty_cache()
