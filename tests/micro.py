"""The micro model (tests/micro.yaml) for real-trial tests that test the tuner, not the model."""

from pathlib import Path

from autotune.values.models import load_model

MICRO_FILE = str(Path(__file__).with_name("micro.yaml"))  # for the CLI: --model MICRO_FILE
MICRO = load_model(MICRO_FILE)
