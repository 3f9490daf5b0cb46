"""Stage 4, fit: measurements -> fitted compute, memory, network, overlap and epochs models, each with its
error (perfmodel/), the cluster's links, and the evidence for the noise scale. See docs/architecture.md."""
