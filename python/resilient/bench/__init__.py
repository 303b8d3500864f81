"""`resilient bench`: checkpoint and restore benchmarks against torch.save and DCP."""
