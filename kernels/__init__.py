"""Pure tensor ops, each a PyTorch reference beside its fast path (Triton, compiled CPU C) with the same contract."""
