"""Values: what crosses module lines, frozen and validated when made. A config's knobs (config), the space of
configs (space), what is trained (workload, shapes, models), the devices it runs on (hardware, with the CUDA
allocator's mode: allocator), the DeepSpeed config a config means (dsconfig), byte sizes (units), a sweep's
settings (settings), one trial's record (results), and the parsers of typed-in values (argtypes). Nothing here
runs a trial or searches, and nothing here imports a higher layer (tests/test_architecture.py)."""
