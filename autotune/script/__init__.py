"""Script mode: tune a user's own DeepSpeed training script, unchanged.

- `shim` (run as `python -m autotune.script <spec.json>`, one process per rank): runs the script with the
  trial's config applied at `deepspeed.initialize`, measures the engine it gets back, ends the run;
- `merge`: the trial's memory-relevant keys over the script's own config;
- `apply` (`python -m autotune.script.apply best_ds_config.json train.py ...`): the recommendation merged the
  same way into the config a script builds in code, for launch.sh's command (no measuring);
- `inspect_model`: the model's shape and checkpointing switch, for the estimator;
- `alike`: the one rule by which a failure after `deepspeed.initialize` is the script's (two configs failing the
  same way after their steps), which stops the sweep;
- `accelerate_loop`, `lightning_loop` (with `loaders`): a hand-written Accelerate loop and a Lightning
  script, whose own DataLoader and gradient accumulation are brought to the trial's;
- `session`: what `autotune tune --script` and `autotune trial --script` add (the first trial learns the
  model, the space loses knobs the script cannot apply, the outputs carry the script's own config).
The backend is autotune.backends.script.
"""
