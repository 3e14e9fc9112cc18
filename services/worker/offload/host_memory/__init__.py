"""Host memory and the PCIe link out of it: where the misses are copied from, and how they cross.

* host_banks.py: `HostBanks`, every routed expert in pinned host memory, plain; the host-RAM check; its
  `copy_experts` (the copy engine) and `copy_listed` (kernels/expert_copy.py) move experts into slots;
* packed_banks.py: `PackedHostBanks`, the same role in 12 bits a value, unpacked on the GPU as they cross;
* huge_pages.py: transparent huge pages advised for the bank blocks;
* staging_ring.py: `StagingRing`, the staging slots a prefill streams its missed experts through."""
