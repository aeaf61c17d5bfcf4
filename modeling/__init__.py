"""What the actor runs beyond a dense text model: mixture-of-experts routing, Qwen3.5's Gated
DeltaNet layers, vision towers, fused kernels' references, Ulysses sequence parallelism."""
