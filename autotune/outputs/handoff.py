"""From a recommendation to the user's training run: the files each training stack takes as written, the
instructions that go with them, and the space narrowed to what the user's stack can apply.

Stacks (`--stack`, `TuneSpec.stack`):
- `deepspeed`: the user's own loop around `deepspeed.initialize`; every knob applies (activation
  checkpointing in segments of k layers is the model's code: `checkpoint_code`).
- `trainer`: the Hugging Face Trainer. Its `activation_checkpointing` (`gradient_checkpointing` before
  transformers 5.x; the key follows the installed version: `checkpointing_key`) checkpoints every layer or none,
  so the space keeps ckpt_interval 0 and 1 only. (transformers 5.x's `every_n_layers` checkpoints one layer in n
  and keeps the others' activations whole: another trade than segments of k layers, not tuned here.)
- `accelerate`: Accelerate's DeepSpeed integration; checkpointing is the model's
  `activation_checkpointing_enable()` (`gradient_checkpointing_enable()` before transformers 5.x), every layer or
  none as well.

Files (all in the run directory): `best_ds_config.json` (complete, for `deepspeed.initialize`),
`best_hf_ds_config.json` ("auto" only for the recipe's learning rate, weight decay and clipping:
dsconfig.hf_ds_config), `recommended_trainer_args.json` (the `TrainingArguments` keyword arguments that
match it), `best_accelerate_config.yaml` (for `accelerate launch --config_file`), `launch.sh` (the launch command
with the trials' environment: autotune.outputs.launch).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.values.config import Config, ConfigError
from autotune.values.dsconfig import RECIPE_AUTO, DsOptions, ds_config, hf_ds_config
from autotune.values.hardware import Hardware
from autotune.outputs.launch import LAUNCH_FILE, Launch, Origin, ops_built, template_reason, trials_environment
from autotune.values.settings import DEFAULT_STACK, STACKS, RunSettings, check_stack  # noqa: F401  (the stacks' names are settings)
from autotune.values.space import Choices
from autotune.values.workload import Workload
from autotune.worker.imports import accelerator_guess_unsaid, environ_kept, mlflow_kept_out
from autotune.values.units import counted

if TYPE_CHECKING:  # rundir reads the stack names from here
    from autotune.search.rundir import RunFolder

SWITCH_INTERVALS = (0, 1)  # what an on/off gradient_checkpointing applies: none, or every layer

DS_CONFIG = "best_ds_config.json"
HF_DS_CONFIG = "best_hf_ds_config.json"
TRAINER_ARGS = "recommended_trainer_args.json"
ACCELERATE_CONFIG = "best_accelerate_config.yaml"

_STACK_NAMES = {"trainer": "the Hugging Face Trainer", "accelerate": "Accelerate"}
_SWITCH = {"trainer": "`TrainingArguments(activation_checkpointing=...)` (`gradient_checkpointing` before transformers 5.x)",
           "accelerate": "the model's `activation_checkpointing_enable()` (`gradient_checkpointing_enable()` before "
                         "transformers 5.x)"}


@functools.cache
def checkpointing_key() -> str:
    """The installed transformers' TrainingArguments field that switches activation checkpointing:
    `activation_checkpointing` where it has one (5.x: `gradient_checkpointing` is its deprecated alias, to be
    removed in v6), else `gradient_checkpointing` (older versions, or no transformers here)."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return "gradient_checkpointing"
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def narrow_choices(choices: Choices, stack: str) -> tuple[Choices, str | None]:
    """The knob values `stack` can apply, and a sentence naming what was removed and why (None: nothing)."""
    if check_stack(stack) == "deepspeed":
        return choices, None
    wanted = choices.ckpt_interval
    kept = tuple(v for v in wanted if v in SWITCH_INTERVALS)
    removed = [v for v in wanted if v not in SWITCH_INTERVALS]
    if not kept:
        raise ConfigError(f"--stack (`stack`) {stack}: the space's ckpt_interval {list(wanted)} holds no value {_STACK_NAMES[stack]} "
                          "can apply: allowed 0 (off) and 1 (every layer)")
    if not removed:
        return choices, None
    return replace(choices, ckpt_interval=kept), (
        f"--stack {stack}: ckpt_interval {removed} removed from the space ({_STACK_NAMES[stack]} switches activation "
        f"checkpointing on or off through {_SWITCH[stack]}: every layer or none); tried: {list(kept)}")


def stack_line(stack: str) -> str | None:
    """The report's line on the stack the space was narrowed to (None for deepspeed: nothing narrowed)."""
    if stack == "deepspeed":
        return None
    return (f"{stack}: the space held only what {_STACK_NAMES[stack]} can apply (ckpt_interval 0 or 1: activation "
            f"checkpointing off or on every layer, through {_SWITCH[stack]})")


@dataclass(frozen=True)
class Handoff:
    """The recommended `config` for `workload` on `hardware`, handed to the user's `stack`; files in `folder`
    (referred to by absolute path, so that the configs work from any working directory)."""

    config: Config
    workload: Workload
    hardware: Hardware
    stack: str
    folder: Path
    options: DsOptions = DsOptions()
    template: str = ""  # why launch.sh is a template for the target (autotune.outputs.launch.template_reason)
    origin: Origin | None = None  # where the trials were started (None: here)

    @classmethod
    def of(cls, config: Config, settings: RunSettings, folder: Path, origin: Origin | None = None) -> "Handoff":
        return cls(config, settings.workload, settings.hardware, settings.stack, folder.resolve(),
                   DsOptions(nvme_path=settings.choices.nvme_path), template_reason(settings.backend, settings.hardware),
                   origin)

    @property
    def accumulation(self) -> int:
        gas = self.workload.grad_accumulation(self.config.micro_batch)
        if gas is None:
            raise ConfigError(f"micro_batch {self.config.micro_batch} does not divide global batch "
                              f"{self.workload.global_batch} over {self.workload.gpus} GPU(s)")
        return gas

    def ds_config(self) -> dict[str, Any]:
        return ds_config(self.config, self.workload, self.options)

    def hf_ds_config(self) -> dict[str, Any]:
        return hf_ds_config(self.config, self.workload, self.options)

    def trainer_args(self) -> dict[str, Any]:
        """`TrainingArguments` keyword arguments that match `best_hf_ds_config.json` (the Trainer checks each)."""
        args: dict[str, Any] = {
            "per_device_train_batch_size": self.config.micro_batch,
            "gradient_accumulation_steps": self.accumulation,
            "bf16": self.config.precision == "bf16",
            "fp16": self.config.precision == "fp16",
            # on/off: every layer. An interval k > 1 (stack deepspeed only) is not the Trainer's to apply;
            # every layer is the nearest it can, with less memory than measured.
            checkpointing_key(): self.config.ckpt_interval > 0,
            "deepspeed": str(self.folder / HF_DS_CONFIG),
        }
        if self.hardware.is_cpu:
            args["use_cpu"] = True  # DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu)
        return args

    def trainer_flags(self) -> list[str]:
        """The same arguments as command-line flags (HfArgumentParser)."""
        flags: list[str] = []
        for key, value in self.trainer_args().items():
            flags += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
        return flags

    def accelerate_config(self) -> dict[str, Any]:
        """An `accelerate launch --config_file` config: DeepSpeed with `best_hf_ds_config.json`. No mixed
        precision or other DeepSpeed keys beside the file: Accelerate refuses them with a config file."""
        nodes = -(-self.workload.gpus // self.ranks_per_node)
        return {
            "compute_environment": "LOCAL_MACHINE",
            "debug": False,
            "deepspeed_config": {"deepspeed_config_file": str(self.folder / HF_DS_CONFIG),
                                 "zero3_init_flag": self.config.zero_stage == 3},
            "distributed_type": "DEEPSPEED",
            "machine_rank": 0,
            "main_training_function": "main",
            "num_machines": nodes,
            "num_processes": self.workload.gpus,
            "rdzv_backend": "static",
            "same_network": True,
            "use_cpu": False,  # DeepSpeed's own accelerator decides the device (DS_ACCELERATOR=cpu on a CPU)
        }

    def accelerate_yaml(self) -> str:
        import yaml

        nodes = self.accelerate_config()["num_machines"]
        header = [f"# ds-autotune: {self.config.label()} for {self.workload.model.name}, global batch "
                  f"{self.workload.global_batch} on {counted(self.workload.gpus, 'process', 'processes')}.",
                  f"# accelerate launch --config_file {ACCELERATE_CONFIG} train.py   (see report.md: DummyOptim, "
                  "DummyScheduler, accelerator.accumulate)"]
        if nodes > 1:
            header.append(f"# {nodes} machines: on each set machine_rank, main_process_ip and main_process_port")
        return "\n".join(header) + "\n" + yaml.safe_dump(self.accelerate_config(), sort_keys=True)

    @property
    def ranks_per_node(self) -> int:
        """As many ranks per machine as the hardware has devices; on the CPU every rank on this machine, where
        its trials ran them (DeepSpeed's CPU accelerator runs any count, sharing the cores)."""
        if self.hardware.is_cpu:
            return self.workload.gpus
        return min(self.workload.gpus, max(1, self.hardware.gpus_per_node))

    def launch(self) -> Launch:
        """The launch command: this many processes, `ranks_per_node` per machine, in the environment the runner
        gives a trial's ranks on this machine."""
        per_node = self.ranks_per_node
        bin_dir, settings = trials_environment(self.hardware.accelerator, per_node, self.hardware.allocator, self.origin)
        return Launch(self.workload.gpus, per_node, bin_dir, settings, self.stack, str(self.folder / ACCELERATE_CONFIG),
                      tuple(self.trainer_flags()) if self.stack == "trainer" else (),
                      f"{self.config.label()} for {self.workload.model.name}, global batch {self.workload.global_batch}",
                      template=self.template)

    def write(self, run: RunFolder) -> list[Path]:
        """Write the five files (the DeepSpeed config checked with DeepSpeed's own parser first)."""
        ds = self.ds_config()
        validate(ds, self.workload.gpus)
        return [run.write_json(DS_CONFIG, ds), run.write_json(HF_DS_CONFIG, self.hf_ds_config()),
                run.write_json(TRAINER_ARGS, self.trainer_args()),
                run.write_text(ACCELERATE_CONFIG, self.accelerate_yaml()),
                run.write_text(LAUNCH_FILE, self.launch().script())]

    # ---- what a person reads: the console's lines and the report's section ----

    def console_lines(self) -> list[str]:
        d = self.folder
        lines = [f"recommended config: {d / DS_CONFIG} (deepspeed.initialize(..., config=...))",
                 f"Hugging Face Trainer: TrainingArguments(**json.load(open('{d / TRAINER_ARGS}')), ...), i.e. "
                 + shlex.join(self.trainer_flags()),
                 f"Accelerate: accelerate launch --config_file {d / ACCELERATE_CONFIG} train.py "
                 "(DummyOptim/DummyScheduler and accelerator.accumulate: see report.md)"]
        mismatch = self.ckpt_mismatch()
        if mismatch:
            lines.append(mismatch)
        return lines + self.launch().console_lines(str(d / LAUNCH_FILE))

    def ckpt_mismatch(self, see: str = "see report.md") -> str | None:
        """What the Trainer and Accelerate cannot apply of this config (an interval k > 1), or None; `see`: where
        the code that applies it is."""
        k = self.config.ckpt_interval
        if k <= 1:
            return None
        return (f"ckpt_interval {k} is applied in the model's code ({see}); the Trainer's and Accelerate's "
                "gradient checkpointing checkpoints every layer instead (less memory, slower than measured; their "
                "every_n_layers is another scheme, one layer in n): "
                "tune with --stack trainer or --stack accelerate for a recommendation they apply as measured")

    def markdown(self) -> list[str]:
        """The report's section. Its paths are relative to the run directory (a copied run directory
        regenerates the same report); the trainer arguments and the Accelerate config hold absolute ones."""
        return replace(self, folder=Path())._markdown()

    def _markdown(self) -> list[str]:
        c, w = self.config, self.workload
        m, a = c.micro_batch, self.accumulation
        lines = ["## Using the recommendation", "",
                 f"Stack: `{self.stack}` (`--stack`). " + self._stack_sentence(), "",
                 f"Every file below holds the tuned values ({c.label()}): micro-batch {m} per process, "
                 f"{counted(a, 'accumulation step')}, {counted(w.gpus, 'process', 'processes')} (global batch {w.global_batch} = {m} x {a} x "
                 f"{w.gpus}), {c.precision}, ZeRO-{c.zero_stage}, offload optimizer {c.offload_optimizer} / "
                 f"parameters {c.offload_param}, and the bucket sizes it ran with. Launch {counted(w.gpus, 'process', 'processes')} "
                 f"(one per device) through a launcher: `{LAUNCH_FILE}` (below).",
                 "", f"Paths below are relative to this run directory; `{TRAINER_ARGS}` and `{ACCELERATE_CONFIG}` name "
                 f"`{HF_DS_CONFIG}` by its absolute path, so that they work from any directory.", ""]
        lines += self._launch_section()
        lines += self._deepspeed_section() + self._trainer_section() + self._accelerate_section()
        return lines

    def _launch_section(self) -> list[str]:
        launch = self.launch()
        extensions = launch.env()["TORCH_EXTENSIONS_DIR"]
        return ["### Launching", "",
                f"`python train.py` alone fails (DeepSpeed needs a launcher's RANK, WORLD_SIZE and MASTER_ADDR/PORT; "
                f"without them it looks for MPI: `No module named 'mpi4py'`). `{LAUNCH_FILE}` starts your script under "
                "a launcher with the recommendation's process count and the environment the trials ran in:", "",
                "```", *(f"bash {LAUNCH_FILE} {line}" for line in launch.usage()), "```", "",
                "It runs, written out (one of the forms):", "", "```bash", *launch.commands(), "```", "",
                f"A template for the target: {launch.template}; a sweep of real trials there writes them." if launch.template
                else f"`TORCH_EXTENSIONS_DIR={extensions}` is where the tuner built DeepSpeed's C++ ops (cpu_adam, "
                "fused_adam, as the trials needed them): with it, and the tuner's Python first on `PATH` (its "
                "ninja), your first run loads them instead of rebuilding them under `~/.cache/torch_extensions` "
                "(minutes). Another Python environment or machine builds its own once." if ops_built(extensions)
                else f"`TORCH_EXTENSIONS_DIR={extensions}` is where DeepSpeed builds its C++ ops on first use (cpu_adam, "
                "fused_adam): no trial of this sweep built one here, so your first run builds those it needs once "
                "(minutes), and later runs load them.", ""]

    def _stack_sentence(self) -> str:
        if self.stack == "deepspeed":
            return ("Every knob applies in your own loop around `deepspeed.initialize`; with the Trainer or "
                    "Accelerate, tune with `--stack trainer` or `--stack accelerate` so that the space holds only "
                    "what they can apply.")
        return (f"The space held only what {_STACK_NAMES[self.stack]} can apply: activation checkpointing off (0) "
                f"or on every layer (1), through {_SWITCH[self.stack]}; an interval of k > 1 layers needs the "
                "model's own code (`--stack deepspeed`).")

    def _deepspeed_section(self) -> list[str]:
        lines = ["### DeepSpeed", "",
                 f"`{DS_CONFIG}` is complete (its AdamW learning rate {self.options.lr:g}, weight decay "
                 f"{self.options.weight_decay:g} and clipping {self.options.gradient_clipping:g} are placeholders for "
                 "your recipe's):", "", "```python",
                 f'engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), '
                 f'config="{self.folder / DS_CONFIG}")',
                 f"for batch in loader:  # batches of {self.config.micro_batch} per process",
                 "    loss = engine(batch)", "    engine.backward(loss)",
                 f"    engine.step()  # steps the optimizer every {counted(self.accumulation, 'micro-batch', 'micro-batches')}", "```", ""]
        return lines + self.checkpoint_code()

    def checkpoint_code(self) -> list[str]:
        """How to apply ckpt_interval k in the model's code, as the tuned trials did."""
        k = self.config.ckpt_interval
        if k == 0:
            return ["Activation checkpointing: off.", ""]
        layers = self.workload.model.layers
        segments = -(-layers // k)
        what = "every layer" if k == 1 else f"segments of {k} layers ({segments} segments of the {layers} layers)"
        return [f"Activation checkpointing: {what}. The trials ran each segment under non-reentrant "
                "`torch.utils.checkpoint` (only a segment's input is kept; one segment is recomputed at a time in "
                "the backward pass); in the model's forward:", "", "```python",
                "from torch.utils.checkpoint import checkpoint", "",
                "def run_segment(x, layers):",
                "    for layer in layers:",
                "        x = layer(x)",
                "    return x", "",
                f"k = {k}  # layers per checkpointed segment",
                "for start in range(0, len(self.layers), k):",
                "    x = checkpoint(run_segment, x, self.layers[start:start + k], use_reentrant=False)",
                "```", "",
                f"`deepspeed.checkpointing.checkpoint(segment_forward, x)` over the same segments works too, after "
                f"`deepspeed.checkpointing.configure(None, deepspeed_config=\"{DS_CONFIG}\")` (its "
                f"`activation_checkpointing` section says {segments} checkpoints)"
                + (". A Hugging Face model: `model.activation_checkpointing_enable()` (`gradient_checkpointing_enable()` "
                   "before transformers 5.x) is exactly this." if k == 1 else
                   "."), ""]

    def _trainer_section(self) -> list[str]:
        flags = shlex.join(self.trainer_flags())
        auto = ", ".join(f"`{key}`" for key in RECIPE_AUTO)
        lines = ["### Hugging Face Trainer", "",
                 f"`{TRAINER_ARGS}` holds the `TrainingArguments` that match `{HF_DS_CONFIG}` (the Trainer refuses "
                 "a config whose batch, accumulation or precision differs from its arguments):", "", "```python",
                 f'args = TrainingArguments(output_dir="out", **json.load(open("{self.folder / TRAINER_ARGS}")))',
                 "```", "", "or on the command line:", "", "```", flags, "```", "",
                 f'"auto" in `{HF_DS_CONFIG}`: {auto} only, filled from your `learning_rate`, `weight_decay` and '
                 "`max_grad_norm`. Adam's betas (0.9, 0.999) and eps (1e-8) are the Trainer's defaults written out: if "
                 "you set `adam_beta1`, `adam_beta2` or `adam_epsilon`, change them in the file too. The learning-rate "
                 "schedule stays the Trainer's (`lr_scheduler_type`).", ""]
        mismatch = self.ckpt_mismatch("its code is under Activation checkpointing, above")
        if mismatch:
            lines += [f"Note: {mismatch}.", ""]
        return lines

    def _accelerate_section(self) -> list[str]:
        m = self.config.micro_batch
        return ["### Accelerate", "",
                f"`accelerate launch --config_file {self.folder / ACCELERATE_CONFIG} train.py`, or in code "
                f"`DeepSpeedPlugin(hf_ds_config=\"{self.folder / HF_DS_CONFIG}\")`. The config's optimizer is "
                "DeepSpeed's AdamW, so the script passes `DummyOptim` (its `lr` and `weight_decay` fill the "
                "config's \"auto\"), and its schedule through `DummyScheduler(..., lr_scheduler_callable=...)`; "
                "accumulation happens inside `accelerator.accumulate(model)`:", "", "```python",
                "from accelerate import Accelerator",
                "from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler",
                "from transformers import get_linear_schedule_with_warmup", "",
                "accelerator = Accelerator()  # under accelerate launch; or:",
                f'# accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config="{self.folder / HF_DS_CONFIG}"))',
                "optimizer = DummyOptim(model.parameters(), lr=3e-4, weight_decay=0.01)",
                "scheduler = DummyScheduler(optimizer, lr_scheduler_callable=lambda opt: "
                "get_linear_schedule_with_warmup(opt, 100, 10_000))",
                f"loader = DataLoader(dataset, batch_size={m})  # the micro-batch",
                "model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)",
                "for batch in loader:",
                "    with accelerator.accumulate(model):",
                "        loss = model(**batch).loss",
                "        accelerator.backward(loss)",
                "        optimizer.step()", "        scheduler.step()", "        optimizer.zero_grad()",
                "```", "",
                "Precision, ZeRO, offload, batch and accumulation come from the file; set no `mixed_precision` or "
                "`gradient_accumulation_steps` beside it."
                + (" Activation checkpointing: call `model.activation_checkpointing_enable()` "
                   "(`gradient_checkpointing_enable()` before transformers 5.x) before `prepare`."
                   if self.config.ckpt_interval else ""), ""]


def validate(ds: dict[str, Any], world_size: int = 1) -> Any:
    """Parse with DeepSpeed's own `DeepSpeedConfig`; raises what DeepSpeed raises.

    Without an initialised process group the parser assumes one rank, so the batch is checked per rank
    (train_batch_size / world_size = micro-batch x accumulation) — the same arithmetic.
    """
    # MLflow kept out: 1-4 s of the tuner's start (autotune.outputs.tracking may still import MLflow later)
    with mlflow_kept_out(), accelerator_guess_unsaid(), environ_kept():
        from deepspeed.runtime.config import DeepSpeedConfig

    checked = copy.deepcopy(ds)
    if isinstance(checked.get("train_batch_size"), int):
        checked["train_batch_size"] //= world_size
    return DeepSpeedConfig(checked)
