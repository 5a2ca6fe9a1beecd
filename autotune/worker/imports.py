"""Importing DeepSpeed without MLflow.

DeepSpeed's autotuner module, which `import deepspeed` pulls in (through deepspeed.runtime.config) and no trial
runs, does `import mlflow` wherever MLflow is installed: 4.0 of the 5.0 s `import deepspeed` took (pandas and
MLflow's tracking client; python -X importtime, a 2-core Xeon under load 5), paid by every rank of every trial
and by the tuner's own config checks. DeepSpeed then only records `has_mlflow = False`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Iterator

_MODULE = "mlflow"


def without_mlflow() -> None:
    """For good, in a process that never uses MLflow (a rank of the built-in model, the op preflight)."""
    sys.modules.setdefault(_MODULE, None)  # type: ignore[arg-type]  # None: `import mlflow` raises ImportError


@contextlib.contextmanager
def mlflow_kept_out() -> Iterator[None]:
    """While inside, `import mlflow` fails (unless MLflow is imported already); importable again after, for the
    tuner's tracking (autotune.outputs.tracking) or a user's script."""
    added = _MODULE not in sys.modules
    if added:
        without_mlflow()
    try:
        yield
    finally:
        if added and sys.modules.get(_MODULE, False) is None:
            del sys.modules[_MODULE]


class _AcceleratorGuess(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU")


@contextlib.contextmanager
def accelerator_guess_unsaid() -> Iterator[None]:
    """While inside, DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to
    detect it." (its logger's warning, on stdout, at `import deepspeed` where no GPU is seen) is left out: the tuner's
    own process imports DeepSpeed only to check configs (autotune.outputs.handoff.validate), `autotune.tune()` prints
    nothing, and the trials name their accelerator themselves (DS_ACCELERATOR)."""
    logger, guess = logging.getLogger("DeepSpeed"), _AcceleratorGuess()
    logger.addFilter(guess)
    try:
        yield
    finally:
        logger.removeFilter(guess)


@contextlib.contextmanager
def environ_kept() -> Iterator[None]:
    """os.environ as it was before, whatever an import inside set: DeepSpeed's parser pulls in lightning_fabric,
    which sets PYTORCH_NVML_BASED_CUDA_CHECK=1 (ARCHITECTURE.md: importing a module never changes os.environ)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
