"""The layers model families share (services/worker/models/ composes them): full attention over the paged KV
pool, the Gated DeltaNet mixer, the RMSNorm variants, the rotary embedding, the MoE block and the dense MLP,
and the step context every layer reads. A layer knows the spec's fields, never a family's name."""
