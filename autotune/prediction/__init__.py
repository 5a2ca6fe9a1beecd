"""Prediction, before anything runs: per-device memory and step time of a config (estimate, with comm and
cuda_memory), the estimator fitted to measured trials (calibrate), how far to trust it (uncertainty), carried
to another device count (scale), and ranked over a whole space (ranking). It imports only values."""
