"""One scheduler step on the worker: forget, register, forward, sample (shared/step.py's contract).

A decode step that a CUDA graph covers (decode_graphs.py) replays it, and when every row's sampling
is plain (temperature only: `Sampler.graph_sampling`) the graph's own samples are the step's, so the
host's part is an input copy, the noise draws, the replay and a result copy; otherwise the sampler
runs on the graph's logits. Any other step runs the model eagerly. Either way the host waits for the
device once per step, for the sampled tokens (and, queued before them, the expert store's
statistics); everything before is queued without waiting (the sampler decides from the requests'
parameters, the inputs cross in one copy). Every step leaves its samples in the graphs'
`last_tokens`, where the next step's graph takes the tokens of the rows it is fed.

Log-probabilities ride along: the sampled tokens' (and their top alternatives) for requests that ask,
computed from the logits the step has anyway; prompt tokens' for the rows StepBatch.prompt_logprobs
marks, which need the logits of every position of those rows' chunks: such a step runs eagerly
(DecodeGraphs.bucket_for refuses it), keeps the model's hidden states, and turns the marked rows into
logits in slices no larger than the sampling logits of a full batch. Steps that ask for neither run
exactly as before.

Linear-state snapshots (hybrid models' prefix cache) ride along too: a row's slot takes a snapshot's
state before the forward (StepBatch.restore_state), a snapshot takes a row's state after it
(StepBatch.save_state); device-to-device copies queued with the step, eagerly around a graph replay."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ferry.kernels.host_to_device import to_device
from ferry.plan.model_config import ModelSpec
from ferry.plan.planner import Plan
from ferry.services.worker.decode_graphs import DecodeGraphs
from ferry.services.worker.forward_batch import ForwardBatch
from ferry.services.worker.grammar import tokenizer_factory
from ferry.services.worker.mtp_drafts import MtpDrafter
from ferry.services.worker.offload.stores.expert_store import ExpertStore, is_long_context
from ferry.services.worker.pools import Pools
from ferry.services.worker.sampler import Sampler, log_softmax_top
from ferry.services.worker.speculative_verify import verify_drafts
from ferry.shared.contract import StepLimits, step_problems
from ferry.shared.errors import FerryError
from ferry.shared.step import Logprobs, StepBatch, StepOutput


class StepBatchError(FerryError):
    """A StepBatch breaks the plan's limits or the contract's shapes: a scheduler bug, never a user's."""


class StepExecutor:
    def __init__(
        self,
        model,
        pools: Pools,
        spec: ModelSpec,
        plan: Plan,
        device: torch.device | str,
        sampler_seed: int | None = None,
        store: ExpertStore | None = None,
        graphs: DecodeGraphs | None = None,
        tokenizer_dir=None,
        eos_token_ids: tuple[int, ...] = (),
        mtp_head=None,
    ):
        """`store`: the model's expert store, told when each step ends and asked for its statistics;
        `graphs`: the captured decode graphs (CUDA), or None to run every step eagerly; `tokenizer_dir`:
        where the model's tokenizer is, for requests with a grammar (structured outputs); `mtp_head`: the MTP
        draft head (--speculative-method mtp), whose K/V every step then writes and which chains the drafts rows
        ask for (mtp_drafts.py)."""
        self.model = model
        self.store = store
        self.mtp = (
            None if mtp_head is None else MtpDrafter(mtp_head, model, pools, plan.kv.page_size, torch.device(device))
        )
        self.graphs = graphs
        self.pools = pools
        self.spec = spec
        self.plan = plan
        self.device = torch.device(device)
        grammar_tokenizer = (
            None if tokenizer_dir is None else tokenizer_factory(tokenizer_dir, spec.vocab_size, eos_token_ids)
        )
        self.sampler = Sampler(spec.vocab_size, self.device, seed=sampler_seed, grammar_tokenizer=grammar_tokenizer)
        self._last_sampled: tuple | None = None  # (req ids, device tokens) the last launched step sampled
        # FERRY_STEP_TRACE (the worker sets it): time each step on the device, and the device's idle time before it
        self.trace_device = False
        self._last_end: torch.cuda.Event | None = None

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self._graphs

    @graphs.setter
    def graphs(self, graphs: DecodeGraphs | None) -> None:
        """The decode graphs, and the MTP chain's among them for the drafter."""
        self._graphs = graphs
        if self.mtp is not None:
            self.mtp.graphs = graphs.chains if graphs is not None else None

    def execute(self, batch: StepBatch) -> StepOutput:
        return self.finish(self.launch(batch))

    def launch(self, batch: StepBatch) -> "_Launched":
        """Queue the step on the device (forward, sampling, the copies of its results to the host)
        without waiting for it; `finish` waits and builds its StepOutput. The worker launches a step
        scheduled ahead before finishing the one before it, whose sampled tokens feed it on the device."""
        previous, self._last_sampled = self._last_sampled, None  # a fed row may only read the step just before
        self._check(batch)  # before anything changes: a step that breaks the contract changes nothing
        feed_src = self._feed_sources(batch, previous)
        for req_id in batch.finished_req_ids:
            self.sampler.remove_request(int(req_id))
        for new in batch.new_requests:
            self.sampler.add_request(new)
        sample_mask = batch.sample.astype(bool)
        sampled_ids = np.asarray(batch.req_ids, dtype=np.int64)[sample_mask]
        if len(batch.req_ids) == 0:
            return _Launched(
                batch,
                sampled_ids,
                output=StepOutput(
                    step_id=batch.step_id,
                    req_ids=sampled_ids,
                    token_ids=np.zeros(0, np.int32),
                    logprobs=np.zeros(0, np.float32),
                ),
            )
        drafting = batch.draft_lens is not None and bool(batch.draft_lens.any())
        # a drafting row is several tokens: the decode graphs refuse it (bucket_for); a verify graph replays the
        # step where its rows are all one length (verify_graphs.py), else it runs eagerly
        bucket = self.graphs.bucket_for(batch) if self.graphs is not None else None
        verify_graphs = self.graphs.verify if self.graphs is not None and drafting else None
        verify_shape = verify_graphs.shape_for(batch, feed_src) if verify_graphs is not None else None
        prompt_rows = batch.prompt_logprobs is not None and bool(np.asarray(batch.prompt_logprobs).any())
        prompt_parts: list = []
        ids = sampled_ids.tolist()
        timing = _timing_event(self.device) if self.trace_device else None
        with torch.inference_mode():
            self._restore_states(batch)
            self._hold_states(batch)
            in_graph = None  # the graph's own sampling serves the step: (inverse temperatures, noise rows)
            replay = None  # a decode graph's replay's timing events (StepOutput.decode_step_s)
            # a step with drafts: its forward and verify timed (verify_step_s); not one that ran eagerly beside
            # verify graphs (rows of different lengths, a hybrid's long first row): the steps the controller
            # prices next replay a graph, and an eager one costs several times that
            priced = verify_shape is not None or verify_graphs is None or not verify_graphs.graphs
            verify = [_timing_event(self.device)] if drafting and priced else None
            if bucket is not None:
                in_graph = self.sampler.graph_sampling(ids, self.graphs.noise)
                logits = self.graphs.run(batch, bucket, feed_src, in_graph)
                replay = self.graphs.last_replay
            elif verify_shape is not None:
                logits, hidden, step_tokens = verify_graphs.run(batch, verify_shape)
            elif prompt_rows or self.mtp is not None:  # the MTP head reads the step's hidden states
                fb = self._eager_batch(batch, previous, feed_src)
                step_tokens = fb.tokens
                hidden = self.model.hidden_states(fb, self.pools)
                logits = self.model.logits(hidden[fb.logits_rows])
                if prompt_rows:
                    prompt_parts = self._prompt_logprobs(batch, hidden)
            else:
                logits = self.model(self._eager_batch(batch, previous, feed_src), self.pools)
            self._save_states(batch)
            top = None
            accepted = None
            if drafting:
                tokens, logprobs, accepted, top = self._choose_with_drafts(batch, ids, logits)
                self._put_back_linear_states(batch, accepted)
                if verify is not None:
                    verify.append(_timing_event(self.device))
                if self.graphs is not None:
                    self.graphs.keep_samples(tokens)
                if self.store is not None:
                    self.store.stats_to_host(counted=verify_shape is not None)
                extra = [accepted] + ([] if top is None else list(top[1:]))
                for _, _, _, tensors in prompt_parts:
                    extra.extend(tensors)
                copies = _to_host_async(tokens.to(torch.int32), logprobs.to(torch.float32), *extra)
            elif in_graph is not None:
                if self.store is not None:  # counted in the graph; queued before the results: one wait covers both
                    self.store.stats_to_host(counted=True)
                copies = self.graphs.fetch_samples(bucket, len(ids))
                tokens = self.graphs.last_tokens[: len(ids)]
            else:
                tokens, logprobs = self.sampler.choose(ids, logits)
                top = self.sampler.top_logprobs(ids, logits, tokens)
                if self.graphs is not None:  # where the next step's graph takes its fed tokens from
                    self.graphs.keep_samples(tokens)
                if self.store is not None:
                    self.store.stats_to_host(counted=bucket is not None)
                extra = [] if top is None else list(top[1:])
                for _, _, _, tensors in prompt_parts:
                    extra.extend(tensors)
                copies = _to_host_async(tokens.to(torch.int32), logprobs.to(torch.float32), *extra)
            mtp_drafts = None
            if self.mtp is not None and bucket is not None:  # the graph wrote the head's K/V with its own samples
                step_tokens, hidden = self.graphs.step_tensors(bucket, len(batch.req_ids))
                mtp_drafts = self.mtp.run(batch, step_tokens, hidden, tokens, None, kv_written=in_graph is not None)
            elif self.mtp is not None:  # after the verify: the slots it writes depend on the drafts kept
                mtp_drafts = self.mtp.run(batch, step_tokens, hidden, tokens, accepted)
        self._last_sampled = (sampled_ids, tokens)
        launched = _Launched(
            batch,
            sampled_ids,
            top=top,
            prompt_parts=prompt_parts,
            copies=copies,
            drafting=accepted is not None,
            mtp_drafts=mtp_drafts,
            replay=replay,
            verify=tuple(verify) if verify and verify[0] is not None else None,
            chain_position_s=self.mtp.chain_position_s if mtp_drafts is not None else 0.0,
        )
        if timing is not None:
            launched.timing = (timing, _timing_event(self.device), self._last_end)
            self._last_end = launched.timing[1]
        return launched

    @staticmethod
    def done(launched: "_Launched") -> bool:
        """Whether the device has finished the launched step (its results wait on the host)."""
        event = launched.copies[1] if launched.copies else None
        return event is None or bool(event.query())

    def finish(self, launched: "_Launched") -> StepOutput:
        """Wait for a launched step's results and build its StepOutput (steps finish in launch order)."""
        if launched.output is not None:
            return launched.output
        batch, sampled_ids, top, prompt_parts = (
            launched.batch,
            launched.sampled_ids,
            launched.top,
            launched.prompt_parts,
        )
        token_ids, logprobs, *extra = _wait_for_host(*launched.copies)
        if launched.timing is not None:
            start, end, before = launched.timing  # before: the previous step's end, done before this one began
            end.synchronize()  # recorded just after the results' copy
            launched.device_times = (
                start.elapsed_time(end),
                before.elapsed_time(start) if before is not None else None,
            )
        accepted = extra.pop(0) if launched.drafting else None
        self.sampler.record(*self._produced(batch, sampled_ids, token_ids, accepted))
        sampled_lps = ()
        if top is not None:
            sampled_lps, extra = self._sampled_logprobs(sampled_ids, top[0], extra[:3]), extra[3:]
        prompt_lps = tuple(
            Logprobs(
                req_id=rid,
                start=start,
                token_logprobs=extra[3 * j],
                top_ids=extra[3 * j + 1][:, :k],
                top_logprobs=extra[3 * j + 2][:, :k],
            )
            for j, (rid, start, k, _) in enumerate(prompt_parts)
        )
        output = StepOutput(
            step_id=batch.step_id,
            req_ids=sampled_ids,
            token_ids=token_ids,
            logprobs=logprobs,
            sampled_logprobs=sampled_lps,
            prompt_logprobs=prompt_lps,
            grammar_failures=self.sampler.grammar_failures(sampled_ids.tolist()),
            accepted_drafts=accepted,
            mtp_drafts=launched.mtp_drafts,
            # the replay finished before the results it queued reached the host
            decode_step_s=launched.replay[0].elapsed_time(launched.replay[1]) / 1e3 if launched.replay else 0.0,
            chain_position_s=launched.chain_position_s,
            verify_step_s=launched.verify[0].elapsed_time(launched.verify[1]) / 1e3 if launched.verify else 0.0,
        )
        if self.store is not None:  # after the results reached the host: the step's work is done
            decode = batch.prompt_logprobs is None and bool((batch.query_lens == 1).all())
            self.store.end_step(synced=True, decode_tokens=len(batch.query_lens) if decode else None)
        return output

    def _choose_with_drafts(self, batch: StepBatch, ids: list[int], logits: torch.Tensor):
        """(tokens [S], logprobs [S], drafts kept [S], top logprobs or None) for a step with drafting rows:
        `logits` holds each sampling row's last draft_lens + 1 positions (ForwardBatch.logits_rows). The rows
        without drafts sample as in any step (the sampler, on their last position), the drafting ones are
        verified (speculative_verify.py)."""
        mask = batch.sample.astype(bool)
        spans = batch.draft_lens.astype(np.int64)[mask] + 1
        last = np.cumsum(spans) - 1  # each sampling row's last logits row
        plain = np.flatnonzero(spans == 1)
        drafting = np.flatnonzero(spans > 1)
        n = len(ids)
        tokens = torch.zeros(n, dtype=torch.int64, device=self.device)
        logprobs = torch.zeros(n, dtype=torch.float32, device=self.device)
        accepted = torch.zeros(n, dtype=torch.int32, device=self.device)
        top = None
        if plain.size:
            plain_ids = [ids[i] for i in plain]
            plain_logits = logits[to_device(last[plain], torch.int64, logits.device)]
            t, lp = self.sampler.choose(plain_ids, plain_logits)
            at = to_device(plain, torch.int64, self.device)
            tokens[at], logprobs[at] = t, lp.to(torch.float32)
            top = self.sampler.top_logprobs(plain_ids, plain_logits, t)
            if top is not None:  # its rows are indices into the plain rows: into the step's sampling rows
                top = ([int(plain[i]) for i in top[0]], *top[1:])
        if drafting.size:
            tokens_in = np.asarray(batch.tokens, dtype=np.int64)
            ends = np.cumsum(batch.query_lens.astype(np.int64))[mask]
            drafts = [tokens_in[ends[i] - spans[i] + 1 : ends[i]].tolist() for i in drafting]
            rows = np.concatenate([np.arange(last[i] - spans[i] + 1, last[i] + 1) for i in drafting])
            states = [self.sampler.requests[ids[i]] for i in drafting]
            t, lp, kept = verify_drafts(
                states,
                logits[to_device(rows, torch.int64, logits.device)],
                drafts,
                self.sampler.generator,
                self.spec.vocab_size,
            )
            at = to_device(drafting, torch.int64, self.device)
            tokens[at], logprobs[at], accepted[at] = t, lp, kept
        return tokens, logprobs, accepted, top

    def _hold_states(self, batch: StepBatch) -> None:
        """After the restores, before the forward: each hybrid drafting row's state goes to its hold snapshot
        (StepBatch.hold_state), to be put back where a draft is refused."""
        if batch.hold_state is not None:
            rows = np.flatnonzero(batch.hold_state >= 0)
            self.pools.linear_state.save([(int(batch.linear_state_slots[i]), int(batch.hold_state[i])) for i in rows])

    def _put_back_linear_states(self, batch: StepBatch, accepted: torch.Tensor) -> None:
        """After the verify: the hybrid drafting rows that refused a draft take back the linear state they
        started the step with (shared/speculation.py's computed_after_verify: the tokens they kept are computed
        again with their next row). Decided on the device: no wait for the verify's answer."""
        if batch.hold_state is None:
            return
        rows = np.flatnonzero(batch.hold_state >= 0)
        sampling_row = np.cumsum(batch.sample.astype(np.int64)) - 1  # a drafting row samples
        kept = accepted[to_device(sampling_row[rows], torch.int64, self.device)]
        refused = kept < to_device(batch.draft_lens[rows], torch.int32, self.device)
        state = self.pools.linear_state
        for j, i in enumerate(rows.tolist()):
            slot, snap = int(batch.linear_state_slots[i]), int(batch.hold_state[i])
            for now, held in ((state.conv, state.snapshot_conv), (state.recurrent, state.snapshot_recurrent)):
                # in place, through views: no temporary the size of a state (the plan prices none)
                torch.where(refused[j], held[snap], now[:, slot], out=now[:, slot])

    def _produced(self, batch: StepBatch, sampled_ids: np.ndarray, token_ids: np.ndarray, accepted) -> tuple:
        """(request ids, tokens) of what the step produced, in order: a drafting row's kept drafts, then its
        token (every other sampling row: its token)."""
        if accepted is None:
            return sampled_ids.tolist(), token_ids.tolist()
        mask = batch.sample.astype(bool)
        ends = np.cumsum(batch.query_lens.astype(np.int64))[mask]
        d = batch.draft_lens.astype(np.int64)[mask]
        rids, toks = [], []
        for i, rid in enumerate(sampled_ids.tolist()):
            kept = batch.tokens[ends[i] - d[i] : ends[i] - d[i] + int(accepted[i])].tolist()
            rids += [rid] * (len(kept) + 1)
            toks += kept + [int(token_ids[i])]
        return rids, toks

    def _sampled_logprobs(self, sampled_ids: np.ndarray, rows: list[int], host: list[np.ndarray]) -> tuple:
        token_lps, top_ids, top_lps = host
        out = []
        for j, i in enumerate(rows):
            rid = int(sampled_ids[i])
            state = self.sampler.requests[rid]
            k = state.params.logprobs
            position = len(state.known_tokens) + len(state.output_token_ids) - 1  # the token just recorded
            out.append(
                Logprobs(
                    req_id=rid,
                    start=position,
                    token_logprobs=token_lps[j : j + 1],
                    top_ids=top_ids[j : j + 1, :k],
                    top_logprobs=top_lps[j : j + 1, :k],
                )
            )
        return tuple(out)

    def _prompt_logprobs(self, batch: StepBatch, hidden: torch.Tensor) -> list:
        """[(req_id, start, k, [token logprobs, top ids, top logprobs] on the device)] for the marked rows: the
        log-probability of each next token of the row's chunk that this worker knows (the prompt), from the
        logits of the position before it. Logits are made in slices of at most max_running_requests rows."""
        qstart = np.concatenate([[0], np.cumsum(batch.query_lens)])
        token_rows, targets, parts = [], [], []
        for i in np.flatnonzero(np.asarray(batch.prompt_logprobs)):
            rid = int(batch.req_ids[i])
            state = self.sampler.requests[rid]
            c, q = int(batch.context_lens[i]), int(batch.query_lens[i])
            nxt = [state.token_at(p + 1) for p in range(c, c + q)]
            n = next((j for j, t in enumerate(nxt) if t is None), q)
            if n == 0:
                continue
            parts.append((rid, c + 1, state.params.prompt_logprobs or 0, len(token_rows), n))
            token_rows.extend(range(int(qstart[i]), int(qstart[i]) + n))
            targets.extend(nxt[:n])
        if not parts:
            return []
        k = max(p[2] for p in parts)
        rows = to_device(token_rows, torch.int64, self.device)
        wanted = to_device(targets, torch.int64, self.device)
        slice_rows = max(1, self.plan.max_running_requests)
        pieces = [
            log_softmax_top(self.model.logits(hidden[rows[a : a + slice_rows]]), wanted[a : a + slice_rows], k)
            for a in range(0, len(token_rows), slice_rows)
        ]
        token_lps, top_ids, top_lps = (torch.cat(t) for t in zip(*pieces))
        return [
            (rid, start, kk, [token_lps[a : a + n], top_ids[a : a + n], top_lps[a : a + n]])
            for rid, start, kk, a, n in parts
        ]

    def _restore_states(self, batch: StepBatch) -> None:
        """Before the forward: each restoring row's linear-state slot takes its snapshot (already checked)."""
        if batch.restore_state is not None:
            rows = np.flatnonzero(batch.restore_state >= 0)
            self.pools.linear_state.restore(
                [(int(batch.restore_state[i]), int(batch.linear_state_slots[i])) for i in rows]
            )

    def _save_states(self, batch: StepBatch) -> None:
        """After the forward: each saving row's snapshot takes the state at the end of the row's chunk (rows
        saved inside their chunk were saved by the linear layers, during the forward)."""
        if batch.save_state is not None:
            rows = np.flatnonzero((batch.save_state >= 0) & ~batch.saved_inside())
            self.pools.linear_state.save([(int(batch.linear_state_slots[i]), int(batch.save_state[i])) for i in rows])

    def _feed_sources(self, batch: StepBatch, previous: tuple | None) -> np.ndarray | None:
        """For a step scheduled ahead: for each row, the row of the previous step's sampled tokens (still
        on the device) that is its token, -1 for a row not fed; None when no row is fed. A fed row whose
        request did not sample in the previous step, or whose sampling reads its own output here
        (penalties, a grammar: `record` has not seen the previous token yet), is refused."""
        feed = batch.feed_sampled
        if feed is None or not feed.any():
            return None
        if previous is None:
            raise StepBatchError(f"step {batch.step_id} feeds rows from a previous step, and none came just before it")
        where = {int(r): j for j, r in enumerate(previous[0].tolist())}
        sources = np.full(len(batch.req_ids), -1, dtype=np.int64)
        for i in np.flatnonzero(feed).tolist():
            rid = int(batch.req_ids[i])
            state = self.sampler.requests.get(rid)
            if rid not in where or state is None or state.params.reads_its_output:
                raise StepBatchError(
                    f"step {batch.step_id}: request {rid} is fed a token it did not sample in the "
                    "step just before, or its sampling reads its own output"
                )
            sources[i] = where[rid]
        return sources

    def _eager_batch(self, batch: StepBatch, previous: tuple | None, feed_src: np.ndarray | None) -> ForwardBatch:
        """The step's inputs on the device (the fed rows' tokens put in from the previous step's samples),
        then the expert store told the step begins: a prefill's expert copies start behind the inputs'
        upload (host-to-device copies of both streams may share one copy engine: the first layer must
        not wait behind 32 experts for its inputs) and overlap the first layer's attention."""
        fb = self._forward_batch(batch, previous, feed_src)
        if self.store is not None:
            self.store.begin_step(
                int(fb.tokens.shape[0]),
                self.spec.num_experts_per_tok,
                long_context=is_long_context(batch.query_lens, batch.context_lens),
            )
        return fb

    def _forward_batch(self, batch: StepBatch, previous: tuple | None, feed_src: np.ndarray | None) -> ForwardBatch:
        fb = ForwardBatch.from_step(batch, self.plan.kv.page_size, self.device)
        if feed_src is not None:
            qstart = np.concatenate([[0], np.cumsum(batch.query_lens)])
            rows = np.flatnonzero(feed_src >= 0)
            dst = to_device(qstart[rows].tolist(), torch.int64, self.device)
            src = previous[1].index_select(0, to_device(feed_src[rows].tolist(), torch.int64, self.device))
            fb.tokens.index_copy_(0, dst, src.to(fb.tokens.dtype))
        return fb

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
        limits = StepLimits(
            kv_pages=p.kv.pages,
            page_size=p.kv.page_size,
            linear_state_slots=p.linear_state.slots if self.spec.linear_attention_layers else 0,
            max_running_requests=p.max_running_requests,
            max_prefill_tokens=p.max_prefill_tokens,
            max_model_len=p.max_model_len,
            vocab_size=self.spec.vocab_size,
            linear_state_snapshots=self._snapshot_count(),
            kv_ring_slots=p.kv.ring_slots,
        )
        problems = step_problems(batch, limits, self.sampler.requests)
        if problems:
            raise StepBatchError(f"step {batch.step_id}: " + "; ".join(problems))

    def _snapshot_count(self) -> int:
        linear = self.pools.linear_state if self.spec.linear_attention_layers else None
        return linear.num_snapshots if linear is not None else 0


@dataclass
class _Launched:
    """A step on its way: what `finish` needs (or, for a step of no requests, its output already)."""

    batch: StepBatch
    sampled_ids: np.ndarray
    top: tuple | None = None
    prompt_parts: list = field(default_factory=list)
    copies: tuple = ()  # (host tensors, ready event or None) from _to_host_async
    output: StepOutput | None = None
    drafting: bool = False  # speculative decoding: `copies` holds the drafts kept after the logprobs
    timing: tuple | None = None  # FERRY_STEP_TRACE: (start, end, the previous step's end) timing events
    device_times: tuple | None = None  # (ms on the device, ms the device sat idle before it), once finished
    mtp_drafts: np.ndarray | None = None  # the MTP head's drafts for the sampling rows (StepOutput.mtp_drafts)
    replay: tuple | None = None  # (start, end) timing events around a decode graph's replay (CUDA)
    verify: tuple | None = None  # (start, end) timing events around an eager step's forward and verify (CUDA)
    chain_position_s: float = 0.0  # StepOutput.chain_position_s


def _timing_event(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def _to_host_async(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Queue the tensors' copies to the host (pinned) and an event after them; nothing waits."""
    if not tensors[0].is_cuda:
        return [t.clone() for t in tensors], None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(tensors[0].device))
    return host, done


def _wait_for_host(host: list[torch.Tensor], done) -> list[np.ndarray]:
    """The copies `_to_host_async` (or a graph's result ring) queued, as numpy arrays of their own (a
    ring slot is written again a few steps later), after one wait for everything before them."""
    if done is not None:
        done.synchronize()
    return [h.numpy().copy() for h in host]
