"""Who computes a step's missed experts, as the worker wires it at boot: one object a backend kind.

The plan chooses the backend (plan/expert_backend.py, `--expert-backend auto|gpu|hybrid|cpu`);
`expert_backend_for` is the one place that choice becomes an `ExpertBackend`, and its `attach` wires the
booted offload store for it, after the banks are loaded:

* `GpuBackend`: nothing to attach, every miss crosses PCIe and the GPU computes it (the store as built);
* `HybridBackend`: the host's share of streamed prefills (prefill_share.py) and of decode layers (decode_share.py),
  split by costs measured here on this machine's paths, the prices refined in service;
* `AutoBackend`: hybrid, the decode share kept only where the calibration says the host shortens a decode
  layer and then under the guard (share_guard.py), no prefill share (ExpertBackendPlan.prefill_share);
* `CpuBackend`: hybrid's wiring with costs that hand the host every miss, and no prefetch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import structlog
import torch

from ferry.kernels.expert_host_handoff import host_count_reference
from ferry.kernels.expert_pair_gemv import PAIR_KERNEL_MAX_PAIRS
from ferry.plan.expert_backend import ExpertBackendPlan, format_cpu_list
from ferry.plan.model_config import ModelSpec
from ferry.plan.planner import Plan
from ferry.services.worker.offload.host_compute.decode_share import HostDecodeShare, LinkTraffic, calibrate_handoff
from ferry.services.worker.offload.host_compute.host_experts import HostExperts
from ferry.services.worker.offload.host_compute.host_handoff import choose_handoff, resolve_handoff
from ferry.services.worker.offload.host_compute.prefill_share import HostCost, HostShare, calibrate
from ferry.services.worker.offload.host_compute.share_guard import ShareGuard
from ferry.services.worker.offload.stores.device_driven import DeviceDrivenExperts
from ferry.shared.errors import ConfigError

log = structlog.get_logger("worker")  # the boot's logger: these lines are part of the worker's boot log

# the split's costs under which the host takes every miss (HostCost's and the hand-off kernel's order)
EVERY_MISS_TO_HOST = HostCost(1.0, 0.0, 0.0, 0.0)
EVERY_MISS_TO_HOST_NS = (1, 0, 0, 0)


class ExpertBackend(ABC):
    """A backend kind's boot step: `attach` wires the booted expert store to compute misses its way."""

    def __init__(self, choice: ExpertBackendPlan):
        self.choice = choice

    @abstractmethod
    def attach(self, store, spec: ModelSpec, plan: Plan, dtype: torch.dtype, device: torch.device) -> None:
        """Wire `store` (the booted expert store, its experts loaded) for this backend."""


class GpuBackend(ExpertBackend):
    """--expert-backend gpu, and any plan whose experts all have a slot: the host computes nothing."""

    def attach(self, store, spec: ModelSpec, plan: Plan, dtype: torch.dtype, device: torch.device) -> None:
        """Nothing to wire: the store as built copies every miss over PCIe for the GPU to compute."""


class HybridBackend(ExpertBackend):
    """--expert-backend hybrid: the host computes part of each layer's misses while the rest cross, split by
    costs measured at boot and refined in service. Auto and cpu change the steps below that differ."""

    def attach(self, store, spec: ModelSpec, plan: Plan, dtype: torch.dtype, device: torch.device) -> None:
        """The host's share of streamed prefills and of decode layers, their costs measured here on this
        machine's paths and logged; off (and logged why) where nothing streams through the host's banks."""
        chosen = self.choice
        why = (
            "the model runs on the CPU: every expert is computed there already"
            if device.type != "cuda"
            else "every expert has a GPU slot"
            if not isinstance(store, DeviceDrivenExperts)
            else "the plan has no staging slots for prefills to stream through"
            if store.ring is None
            else None
        )
        if why is not None:
            log.info("host_share_off", reason=why, expert_backend=chosen.requested)
            return
        experts = HostExperts(store.banks, dtype, chosen.host_threads, cpus=chosen.host_cpus)
        pinned = experts.c_kernel.pinned if experts.c_kernel is not None else 0
        cost = calibrate(store, experts, device)
        log.info(
            "host_share",
            expert_backend=chosen.backend,
            requested=chosen.requested,
            threads=chosen.host_threads,
            threads_from=chosen.reason,
            backend=experts.backend,
            cpus=format_cpu_list(chosen.host_cpus),
            workers_pinned=pinned,
            pcie_us=round(cost.pcie_s * 1e6, 1),
            host_us_at_1=round(cost.host_s_at_1 * 1e6, 1),
            host_us_per_token=round(cost.host_s_per_token * 1e6, 2),
            overhead_us=round(cost.overhead_s * 1e6, 1),
        )
        if chosen.prefill_share:
            store.host_share = HostShare(
                experts, self.prefill_costs(cost), plan.max_prefill_tokens, spec.num_experts_per_tok, device
            )
        else:
            log.info(
                "host_prefill_share_off",
                reason="auto: a host share lengthens long prefill steps (--expert-backend hybrid keeps it)",
            )
        self.attach_decode(store, spec, experts, cost, device)

    def prefill_costs(self, cost: HostCost) -> HostCost:
        """The costs the prefill's split decides by: those measured."""
        return cost

    def link_traffic(self, store, device: torch.device) -> LinkTraffic | None:
        """What crosses the link beside a decode layer's hand-off while the host has its share: the next
        layer's prefetch, so each hand-off is timed beside it as well as idle (a round over PCIe waits behind
        the copies). None off CUDA."""
        return LinkTraffic(store.banks, store.ring, device) if torch.device(device).type == "cuda" else None

    def keeps_decode_share(self, share: HostDecodeShare, min_tokens: int | None, fields: dict) -> bool:
        """Whether the decode share is attached after its calibration, and in which launches: always and in
        every launch, where it was asked for. `min_tokens`: the fewest rows a launch has where by the
        calibration the host takes some of a layer's misses (None: none up to the share's max_tokens)."""
        return True

    def price_decode_share(self, share: HostDecodeShare, measured: tuple[int, int, int, int], store) -> None:
        """The decode share's costs: those measured, refined in service, the prefill's share following the
        same host's refined price."""
        share.costs_ns = measured
        share.refines = True
        if store.host_share is not None:
            share.on_refined = store.host_share.follow_host_price

    def attach_decode(self, store, spec: ModelSpec, experts: HostExperts, cost: HostCost, device: torch.device) -> None:
        """The host's share of decode layers' misses (offload/host_compute/decode_share.py): a host node in the decode
        graph, so only the C kernel (no Python, no GIL where it runs); its hand-off measured here."""
        if experts.c_kernel is None:
            log.info(
                "host_decode_off",
                reason="the host's C expert kernel is not available here "
                "(host_experts_torch_path says why): a graph's host node runs it "
                "without Python",
            )
            return
        k = spec.num_experts_per_tok
        ns = [round(v * 1e9) for v in (cost.pcie_s, cost.host_s_at_1, cost.host_s_per_token)]
        share = HostDecodeShare(
            experts.c_kernel, (*ns, 0), max(1, PAIR_KERNEL_MAX_PAIRS // k), k, spec.num_experts, device
        )
        try:
            wanted = resolve_handoff()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        # each hand-off timed on an idle link and beside the decode path's own copies (LinkTraffic): in service
        # that is the price the split and the choice between the two hand-offs need
        traffic = self.link_traffic(store, device)
        node_idle_s = calibrate_handoff(share, store.cache)
        overhead = node_s = calibrate_handoff(share, store.cache, traffic=traffic) if traffic else node_idle_s
        poll_s = poll_idle_s = None
        if (
            wanted != "node"
        ):  # the polled hand-off (offload/host_compute/host_handoff.py), kept where asked or where it is faster
            try:
                share.use_poll()
                poll_idle_s = calibrate_handoff(share, store.cache)
                poll_s = calibrate_handoff(share, store.cache, traffic=traffic) if traffic else poll_idle_s
            except RuntimeError as exc:  # not capturable here, or unanswered: the host node stays
                log.warning("host_decode_poll_off", reason=str(exc).splitlines()[0][:300])
        if choose_handoff(wanted, node_s, poll_s) == "poll":
            overhead = poll_s
        else:
            share.use_node()
        measured = (*ns, round(overhead * 1e9))
        # a launch of t tokens misses about layer_misses(t) experts a layer (before prefetch); the hand-off runs on
        # every layer of a launch it is in, so the share is worth a launch where the host takes some of that many
        slotless = 1 - store.policy.num_slots / max(store.policy.num_layers * spec.num_experts, 1)
        takes_at = host_takes_by_tokens(measured, k, spec.num_experts, slotless, share.max_tokens)
        typical = layer_misses(1, k, spec.num_experts, slotless)[0]
        min_tokens = next((t for t, takes in takes_at.items() if takes), None)
        fields = dict(
            pcie_us=round(cost.pcie_s * 1e6, 1),
            host_us_at_1=round(cost.host_s_at_1 * 1e6, 1),
            handoff_us=round(overhead * 1e6, 1),
            handoff=share.handoff,
            handoff_node_us=round(node_s * 1e6, 1),
            handoff_poll_us=None if poll_s is None else round(poll_s * 1e6, 1),
            handoff_node_idle_us=round(node_idle_s * 1e6, 1),
            handoff_poll_idle_us=None if poll_idle_s is None else round(poll_idle_s * 1e6, 1),
            typical_misses=typical,
            host_takes=takes_at[1],
            host_takes_at_max=takes_at[share.max_tokens],
            min_tokens=min_tokens,
            max_tokens=share.max_tokens,  # caller_pinned 1: the nodes' thread on its CPU
            caller_pinned=share.kernel.caller_pinned,
        )
        if not self.keeps_decode_share(share, min_tokens, fields):
            return
        self.price_decode_share(share, measured, store)
        store.host_decode = share
        log.info("host_decode", **fields)


class AutoBackend(HybridBackend):
    """--expert-backend auto where the plan chose hybrid: the decode share only where the calibration says the
    host shortens a decode layer, kept while the decode steps with it are shorter (share_guard.py)."""

    def keeps_decode_share(self, share: HostDecodeShare, min_tokens: int | None, fields: dict) -> bool:
        """Only in launches of at least `min_tokens` rows, where the host takes some of a layer's misses: a launch
        with the hand-off pays for it on every layer, so a single stream that misses too few to share runs
        without it while 8 streams share theirs. Off where no launch up to the share's max_tokens gains."""
        if min_tokens is not None:
            share.min_tokens = min_tokens
            return True
        share.use_node()  # no share: its polling thread, if any, stops
        fields["handoff"] = share.handoff
        log.info(
            "host_decode_off",
            reason=f"auto: by the calibration the host shortens no decode layer of up to {share.max_tokens} tokens "
            f"(a one-token layer misses {fields['typical_misses']} of its {share.top_k} experts)",
            **fields,
        )
        return False

    def price_decode_share(self, share: HostDecodeShare, measured: tuple[int, int, int, int], store) -> None:
        """Hybrid's prices, under the guard that keeps the share only while its steps are shorter."""
        super().price_decode_share(share, measured, store)
        share.guard = ShareGuard()


class CpuBackend(HybridBackend):
    """--expert-backend cpu: the host computes every miss (what has a GPU slot stays on the GPU)."""

    def prefill_costs(self, cost: HostCost) -> HostCost:
        """Costs that hand the host every missed expert of a prefill."""
        return EVERY_MISS_TO_HOST

    def link_traffic(self, store, device: torch.device) -> LinkTraffic | None:
        """None: nothing crosses beside the hand-off when the host takes every miss, so the idle figure is the one."""
        return None

    def price_decode_share(self, share: HostDecodeShare, measured: tuple[int, int, int, int], store) -> None:
        """Every miss to the host, a rule rather than prices to refine; no prefetch, which would copy over PCIe
        what the host computes."""
        share.costs_ns = EVERY_MISS_TO_HOST_NS
        share.refines = False
        if store.prefetch_enabled:
            store.prefetch_enabled = False
            log.info("expert_prefetch_off", reason="--expert-backend cpu: the host computes every miss")


def layer_misses(tokens: int, top_k: int, num_experts: int, slotless: float) -> tuple[int, int]:
    """(experts, pairs) a decode layer of `tokens` tokens misses with routing spread evenly: the distinct experts of
    tokens x top_k picks, E (1 - (1 - k/E)^t), and the picks, each times `slotless`, the share of experts with no
    slot; at least one expert and one pair (a miss is what the share is for)."""
    distinct = num_experts * (1 - (1 - top_k / num_experts) ** tokens)
    return max(1, round(distinct * slotless)), max(1, round(tokens * top_k * slotless))


def host_takes_by_tokens(
    costs_ns: tuple[int, int, int, int], top_k: int, num_experts: int, slotless: float, max_tokens: int
) -> dict[int, int]:
    """{t: how many of a decode layer's misses the split gives the host in a launch of t tokens}, t = 1 ..
    max_tokens, by the hand-off kernel's rule (host_count_reference) over layer_misses(t)."""
    return {
        t: host_count_reference(*layer_misses(t, top_k, num_experts, slotless), costs_ns)
        for t in range(1, max_tokens + 1)
    }


def expert_backend_for(choice: ExpertBackendPlan) -> ExpertBackend:
    """The backend object for the plan's choice: the one place its names are read."""
    if choice.backend == "gpu":
        return GpuBackend(choice)
    if choice.backend == "cpu":
        return CpuBackend(choice)
    if choice.backend == "hybrid":
        return AutoBackend(choice) if choice.requested == "auto" else HybridBackend(choice)
    raise ValueError(
        f"unknown expert backend {choice.backend!r} in the plan (plan/expert_backend.py chooses one of "
        "gpu, hybrid, cpu)"
    )
