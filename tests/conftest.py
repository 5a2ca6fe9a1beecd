import signal

# No DS_ACCELERATOR here: trials get theirs from the hardware profile (autotune.worker.device), and
# tests/test_devices.py checks that nothing in the package sets it for the process.

# A test run started in the background by a shell without job control (nohup cmd &) inherits SIGINT
# ignored, and would pass that on to every process it starts; the Ctrl-C tests need it delivered, as at a
# terminal (a Python handler, unlike SIG_IGN, is reset to the default in the processes it starts).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
