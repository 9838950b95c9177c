"""One process's upscaling job: batch plan, encode -> DiT -> decode -> colour -> blend, streaming."""
