"""The host computing missed experts where they lie, from the banks the copies read.

* host_experts.py: `HostExperts`, a layer's (token, expert, weight) pairs computed on the host;
* host_expert_kernel.py: the ctypes binding of the C kernel (kernels/host_experts_c/), HostExperts' `c` backend;
* host_expert_weights.py: one expert's weights read from a bank in the compute dtype, HostExperts' `torch` backend;
* prefill_share.py: `HostShare`, the host's share of a streamed prefill's misses;
* decode_share.py: `HostDecodeShare`, the host's share of a decode layer's misses, inside the step's CUDA graph;
* host_handoff.py: how a decode layer's share reaches the host (a host node or a polled word);
* share_guard.py: `ShareGuard`, auto's guard keeping the decode share only while it shortens the steps;
* expert_backends.py: the backend objects (gpu, hybrid, auto, cpu) that wire the above at boot."""
