"""The RL policy: RLlib (PPO, new API stack) training on the Gymnasium environment, and Ray-free inference.

`network` is plain torch (shared by training and inference); `module` is the RLlib RLModule around it;
`train` is the training loop; `policy` loads an exported policy without importing Ray.
Nothing here imports Ray at package import time: inference must stay fast to start.
"""
