"""One scheduler step on the worker: forget, register, forward, sample (shared/step.py's contract).

A decode step that a CUDA graph covers (decode_graphs.py) replays it; any other step runs the
model eagerly. Either way the host waits for the device once per step, for the sampled tokens
(and, queued before them, the expert store's statistics); everything before is queued without
waiting (the sampler decides from the requests' parameters, the inputs cross in one copy)."""

from __future__ import annotations

import numpy as np
import torch

from ferry.shared.contract import StepLimits, step_problems
from ferry.shared.errors import FerryError
from ferry.plan.model_config import ModelSpec
from ferry.shared.step import StepBatch, StepOutput
from ferry.services.worker.decode_graphs import DecodeGraphs
from ferry.services.worker.experts import ExpertStore
from ferry.services.worker.forward_batch import ForwardBatch
from ferry.plan.planner import Plan
from ferry.services.worker.pools import Pools
from ferry.services.worker.sampler import Sampler


class StepBatchError(FerryError):
    """A StepBatch breaks the plan's limits or the contract's shapes: a scheduler bug, never a user's."""


class StepExecutor:
    def __init__(self, model, pools: Pools, spec: ModelSpec, plan: Plan, device: torch.device | str,
                 sampler_seed: int | None = None, store: ExpertStore | None = None,
                 graphs: DecodeGraphs | None = None):  # fmt: skip
        """`store`: the model's expert store, told when each step ends and asked for its statistics;
        `graphs`: the captured decode graphs (CUDA), or None to run every step eagerly."""
        self.model = model
        self.store = store
        self.graphs = graphs
        self.pools = pools
        self.spec = spec
        self.plan = plan
        self.device = torch.device(device)
        self.sampler = Sampler(spec.vocab_size, self.device, seed=sampler_seed)

    def execute(self, batch: StepBatch) -> StepOutput:
        self._check(batch)  # before anything changes: a step that breaks the contract changes nothing
        for req_id in batch.finished_req_ids:
            self.sampler.remove_request(int(req_id))
        for new in batch.new_requests:
            self.sampler.add_request(new)
        sample_mask = batch.sample.astype(bool)
        sampled_ids = np.asarray(batch.req_ids, dtype=np.int64)[sample_mask]
        if len(batch.req_ids) == 0:
            return StepOutput(step_id=batch.step_id, req_ids=sampled_ids, token_ids=np.zeros(0, np.int32),
                              logprobs=np.zeros(0, np.float32))  # fmt: skip
        bucket = self.graphs.bucket_for(batch) if self.graphs is not None else None
        with torch.inference_mode():
            if bucket is not None:
                logits = self.graphs.run(batch, bucket)
            else:
                logits = self.model(ForwardBatch.from_step(batch, self.plan.kv.page_size, self.device), self.pools)
            tokens, logprobs = self.sampler.choose(sampled_ids.tolist(), logits)
            if self.store is not None:
                self.store.stats_to_host()  # queued before the results: the one wait below covers both
            token_ids, logprobs = _to_host(tokens.to(torch.int32), logprobs.to(torch.float32))
        self.sampler.record(sampled_ids.tolist(), token_ids.tolist())
        output = StepOutput(step_id=batch.step_id, req_ids=sampled_ids, token_ids=token_ids, logprobs=logprobs)
        if self.store is not None:  # after the results reached the host: the step's work is done
            self.store.end_step(synced=True)
        return output

    def expert_stats(self) -> tuple[int, int]:
        """(hits, misses) of the expert cache since boot: the worker's heartbeat carries them."""
        if self.store is None:
            return 0, 0
        report = self.store.report()
        return report["hits"], report["misses"]

    def expert_cache_report(self) -> dict:
        """The store's report: cumulative hits, misses, hit_rate, bytes_copied, copy times, the
        last step's figures under "last_step", and policy, slots, residency."""
        if self.store is None:
            raise RuntimeError("this executor was built without an expert store")
        return self.store.report()

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def _check(self, batch: StepBatch) -> None:
        """Cheap host-side checks of what the worker received (shared/contract.py: dtypes and shapes, the
        plan's limits, token ids, page and slot ids, announced requests): an out-of-range page or slot
        would corrupt another request's state, an unknown token or request would fail the step later."""
        p = self.plan
        limits = StepLimits(kv_pages=p.kv.pages, page_size=p.kv.page_size,
                            linear_state_slots=p.linear_state.slots if self.spec.linear_attention_layers else 0,
                            max_running_requests=p.max_running_requests, max_prefill_tokens=p.max_prefill_tokens,
                            max_model_len=p.max_model_len, vocab_size=self.spec.vocab_size)  # fmt: skip
        problems = step_problems(batch, limits, self.sampler.requests)
        if problems:
            raise StepBatchError(f"step {batch.step_id}: " + "; ".join(problems))


def _to_host(*tensors: torch.Tensor) -> list[np.ndarray]:
    """The tensors on the host as numpy arrays, after one wait for everything queued before them."""
    if not tensors[0].is_cuda:
        return [t.numpy() for t in tensors]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(tensors[0].device))
    done.synchronize()
    return [h.numpy() for h in host]
