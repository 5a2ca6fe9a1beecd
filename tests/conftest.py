import os
import signal

# No GPU here or in CI: DeepSpeed's CPU accelerator (gloo). Set before anything imports deepspeed.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# A test run started in the background by a shell without job control (nohup cmd &) inherits SIGINT
# ignored, and would pass that on to every process it starts; the Ctrl-C tests need it delivered, as at a
# terminal (a Python handler, unlike SIG_IGN, is reset to the default in the processes it starts).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
