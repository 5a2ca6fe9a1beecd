import os

# No GPU here or in CI: DeepSpeed's CPU accelerator (gloo). Set before anything imports deepspeed.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
