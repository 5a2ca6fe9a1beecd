"""Trials on this machine: launching one trial's ranks and saying how it ended (runner), the devices here and
the check that a profile can run (devices), DeepSpeed's C++ ops built before the first trial (ops), SIGTERM and
SIGHUP as Ctrl-C (interrupts), and a space recorded as a replay surface (recording). The backends (autotune.backends)
and the rank process (autotune.worker) build on these."""
