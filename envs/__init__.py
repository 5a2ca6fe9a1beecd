"""Gymnasium environments of ds-autotune (installed as `autotune.envs`)."""
