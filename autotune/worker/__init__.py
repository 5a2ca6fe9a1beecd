"""What runs inside a trial's processes, one per rank: the built-in model (`model`), the entry point
(`python -m autotune.worker <spec.json>`, in `main`), and the light modules the runner shares with it
(`protocol`, `measure`, `procmem`), which import neither torch nor DeepSpeed."""
