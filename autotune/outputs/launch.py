"""How to launch a recommendation: `launch.sh` in the run directory (DeepSpeed's own autotuner writes
`cmd_optimal.txt`), shown in report.md and by `autotune tune` (autotune.outputs.handoff).

`python train.py` alone fails with DeepSpeed: without a launcher's RANK, WORLD_SIZE and MASTER_ADDR/PORT,
`deepspeed.init_distributed` falls back to MPI discovery (`No module named 'mpi4py'`). The file starts the
user's script under torchrun or DeepSpeed's launcher (`--stack accelerate`: also `accelerate launch
--config_file`) with the recommendation's process count (--gpus, or --target-gpus when set) and the environment
its trials ran in, as the runner builds it (autotune.trials.runner.trial_environment; OMP threads per rank:
runner.rank_threads), less what only a trial needs (its rendezvous on loopback, unbuffered output):
- PATH with the tuner's Python environment first and TORCH_EXTENSIONS_DIR, the tuner's build of DeepSpeed's
  C++ ops: the user's first run loads them instead of rebuilding them (a user's run rebuilt shm_comm and
  cpu_adam under ~/.cache/torch_extensions: 6 min for 15 s of training; another ninja than the venv's reads
  their build log as stale and rebuilds them too);
- DS_ACCELERATOR, OMP_NUM_THREADS, TORCH_CUDA_ARCH_LIST (as autotune.trials.ops rewrites it) and the caching
  allocator's settings (PYTORCH_CUDA_ALLOC_CONF and its kin), when the trials had them.
A sweep whose trials ran nowhere (the simulated backend predicts, the replay backend reads a surface measured
elsewhere) for an accelerator this machine lacks (template_reason: a GPU profile tuned on a CPU machine) gets a
template for its target instead: this machine's Python, ops folder, thread count and CUDA archs are left for the
user to set; only the hardware profile's accelerator and the sweep's allocator settings are exported.

    bash launch.sh torchrun train.py [args]     torchrun --nnodes 1 --nproc_per_node N train.py [args]
    bash launch.sh deepspeed train.py [args]    deepspeed --num_gpus N train.py [args]
    bash launch.sh accelerate train.py [args]   accelerate launch --config_file .../best_accelerate_config.yaml ...
Options between the launcher's name and the script go to the launcher (`bash launch.sh deepspeed --no_local_rank
train.py`, for a script that takes no --local_rank; in script mode the script may be left out: the tuned command).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from autotune.values.allocator import DEFAULT_ALLOCATOR
from autotune.values.hardware import Hardware
from autotune.values.units import counted

LAUNCH_FILE = "launch.sh"
ORIGIN_FILE = "origin.json"  # the trials' Python and environment, as the last session that ran trials had them
ALLOCATOR_ENV = re.compile(r"PYTORCH_(CUDA_|HIP_)?ALLOC_CONF")  # the caching allocator's settings
# This machine's, not the target's: a template leaves them out (the accelerator and allocator are the profile's).
MACHINE_ENV = ("TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS", "TORCH_CUDA_ARCH_LIST")
ORIGIN_ENV = ("PATH", *MACHINE_ENV)  # what an Origin keeps of the environment (with the allocator's settings)
_WHY = {"TORCH_EXTENSIONS_DIR": "DeepSpeed's C++ ops as the tuner built them: loaded, not rebuilt (minutes)",
        "DS_ACCELERATOR": "DeepSpeed's accelerator of the trials",
        "OMP_NUM_THREADS": "OpenMP threads per rank, as the trials' ranks had them",
        "TORCH_CUDA_ARCH_LIST": "the CUDA archs of the ops' build, as DeepSpeed's op builder parses them"}


@dataclass(frozen=True)
class Setting:
    """One exported variable of the launch file, and why it is there."""

    name: str
    value: str
    why: str

    def export(self) -> str:
        return f"export {self.name}={shlex.quote(self.value)}"


@dataclass(frozen=True)
class Origin:
    """Where a sweep's trials were started: the tuner's Python, the variables of its environment the launch file
    takes, the machine's cores. Each session that runs trials records its own (ORIGIN_FILE), so that `autotune report`
    from another Python environment or machine writes the launch file of the trials' environment, not its own."""

    python: str
    env: Mapping[str, str]
    cpus: int

    @classmethod
    def here(cls) -> "Origin":
        return cls(sys.executable, {k: v for k, v in os.environ.items() if k in ORIGIN_ENV or ALLOCATOR_ENV.fullmatch(k)},
                   os.cpu_count() or 1)

    def to_dict(self) -> dict[str, Any]:
        return {"python": self.python, "env": dict(self.env), "cpus": self.cpus}

    @classmethod
    def read(cls, path: Path) -> "Origin | None":
        """The origin recorded in `path`; None where there is none or it is not one (the file is only ever ours)."""
        try:
            data = json.loads(path.read_text())
            return cls(str(data["python"]), {str(k): str(v) for k, v in data["env"].items()}, int(data["cpus"]))
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None


def trials_environment(accelerator: str, ranks_per_node: int, allocator: str = DEFAULT_ALLOCATOR,
                       origin: Origin | None = None) -> tuple[str, tuple[Setting, ...]]:
    """The tuner's Python environment's bin directory (first on the trials' PATH) and the variables of the trials'
    environment a training run needs, as the runner gives them to `ranks_per_node` ranks of one machine (CUDA: in
    allocator mode `allocator`, as autotune.backends.deepspeed sets it); `origin`: as it gave them where the trials
    were started, else here."""
    from autotune.trials.runner import LaunchOptions, rank_threads, trial_environment

    origin = origin or Origin.here()
    env = trial_environment(LaunchOptions(ranks=ranks_per_node, allocator=allocator, python=origin.python),
                            accelerator, base=origin.env)
    env["OMP_NUM_THREADS"] = rank_threads(env, ranks_per_node, origin.cpus)
    bin_dir = env["PATH"].split(os.pathsep)[0]
    names = [*_WHY, *sorted(name for name in env if ALLOCATOR_ENV.fullmatch(name))]
    why = dict(_WHY)
    if not ops_built(env.get("TORCH_EXTENSIONS_DIR")):  # no trial built one here (simulated, replay): none to reuse
        why["TORCH_EXTENSIONS_DIR"] = UNBUILT
    return bin_dir, tuple(Setting(name, env[name], why.get(name, "the allocator's settings of the trials"))
                          for name in names if name in env)


UNBUILT = "where DeepSpeed builds its C++ ops on first use and loads them after; none built here yet: no trial needed one"


def ops_built(folder: str | None) -> bool:
    """Some DeepSpeed op was built in `folder` (a trial's TORCH_EXTENSIONS_DIR): what launch.sh can promise reused."""
    try:
        return folder is not None and any(Path(folder).iterdir())
    except OSError:
        return False


def template_reason(backend: str, hardware: Hardware) -> str:
    """Why `launch.sh` is a template for the target rather than the environment its trials get: no trial of the
    sweep ran (simulated: predicted; replay: measured elsewhere) and this machine cannot run the target's accelerator
    (a GPU profile on a machine without an NVIDIA driver), so that what the runner would give a trial here is not
    the target's environment. '' where trials ran (deepspeed, script) or would run here as the file says (a CPU
    profile: any machine runs its trials)."""
    from autotune.backends.factory import backend_kind, backend_names
    from autotune.trials.devices import nvidia_driver_present

    # A user's own objective (a name no kind registers) ran in this process: as a real trial, here.
    own = backend not in backend_names(sweep=None)
    if own or backend_kind(backend).real or hardware.is_cpu or nvidia_driver_present():
        return ""
    return (f"no trial of this sweep ran ({backend} backend) and this machine has no {hardware.name}'s accelerator: the "
            "target's Python, ops folder and threads are yours to set")


@dataclass(frozen=True)
class Launch:
    """The recommendation's launch: `processes` ranks, `per_node` on each of its machines, started with `settings`
    and the tuner's Python environment (`bin_dir`) first on PATH. `stack` adds its own form: Accelerate's
    launcher with `accelerate_config`, the Trainer's arguments as flags (`trainer_flags`)."""

    processes: int
    per_node: int
    bin_dir: str
    settings: tuple[Setting, ...]
    stack: str = "deepspeed"
    accelerate_config: str = ""
    trainer_flags: tuple[str, ...] = ()
    title: str = ""  # what is launched, for the file's first line
    template: str = ""  # why no trial ran in this environment ('' when they did): a template for the target
    # What goes after the launcher: script mode's own script and arguments with the recommendation in them; else
    # "train.py" (with the Trainer's flags)
    program: tuple[str, ...] = ()
    no_local_rank: bool = False  # the script's parser takes no --local_rank: DeepSpeed's launcher must not pass it

    @property
    def nodes(self) -> int:
        return -(-self.processes // self.per_node)

    def env(self) -> dict[str, str]:
        return {s.name: s.value for s in self.settings}

    def exported(self) -> tuple[Setting, ...]:
        """The settings the file exports: a template only the profile's accelerator and allocator settings."""
        return tuple(s for s in self.settings if not (self.template and s.name in MACHINE_ENV))

    def launchers(self) -> dict[str, str]:
        """Each launcher's command line before the user's script (shell text: a multi-machine launch reads the
        machine's rank and rendezvous from variables set on each machine)."""
        n, p = self.nodes, self.per_node
        if n == 1:
            forms = {"torchrun": f"torchrun --nnodes 1 --nproc_per_node {p}", "deepspeed": f"deepspeed --num_gpus {p}"}
        else:
            forms = {"torchrun": f"torchrun --nnodes {n} --nproc_per_node {p} "
                                 '--node_rank "${NODE_RANK:?set NODE_RANK: this machine, 0 to ' f'{n - 1}' '}" '
                                 '--master_addr "${MASTER_ADDR:?set MASTER_ADDR: machine 0}" '
                                 '--master_port "${MASTER_PORT:-29500}"',
                     "deepspeed": f"deepspeed --num_nodes {n} --num_gpus {p} "
                                  '--hostfile "${HOSTFILE:?set HOSTFILE: one line per machine, <host> slots=' f'{p}' '}"'}
        if self.no_local_rank:
            forms["deepspeed"] += " --no_local_rank"
        if self.stack == "accelerate":
            forms = {"accelerate": f"accelerate launch --config_file {shlex.quote(self.accelerate_config)}", **forms}
        return forms

    def train(self) -> str:
        """The user's script after a launcher (shell text)."""
        if self.program:
            return shlex.join(self.program)
        return "train.py" + (" " + shlex.join(self.trainer_flags) if self.trainer_flags else "")

    def usage(self) -> list[str]:
        """How the user's script goes after each launcher (the Trainer stack: with its arguments as flags)."""
        return [f"{name} {self.train()}" for name in self.launchers()]

    def script(self) -> str:
        """The text of `launch.sh`."""
        n, p = self.nodes, self.per_node
        where = counted(self.processes, "process", "processes") + (f" on {n} machines of {p}" if n > 1 else "")
        if self.template:
            lines = ["#!/usr/bin/env bash", f"# ds-autotune: TEMPLATE for {self.title} on {where}.",
                     f"# {self.template[0].upper()}{self.template[1:]}.",
                     "# It exports no PATH, TORCH_EXTENSIONS_DIR, OMP_NUM_THREADS or TORCH_CUDA_ARCH_LIST of the tuner's "
                     "machine;", "# a real sweep on the target (--backend deepspeed) writes them."]
        else:
            lines = ["#!/usr/bin/env bash",
                     f"# ds-autotune: {self.title} on {where}, in the environment the tuner gives its trials here."]
        lines += ["# `python train.py` alone fails: DeepSpeed needs a launcher's RANK, WORLD_SIZE and MASTER_ADDR/PORT",
                  "# (without them it looks for MPI: No module named 'mpi4py'). Launch your script with one of:"]
        lines += [f"#   bash {LAUNCH_FILE} {line}" for line in self.usage()]
        if self.program:
            lines.append(f"# With no script after the launcher (`bash {LAUNCH_FILE} torchrun`), the tuned script's command above.")
        lines += self._notes()
        lines += ["set -euo pipefail", ""]
        if not self.template:
            lines += ["# The tuner's Python environment first, as its trials had it: its torch built the ops below and "
                      "its", "# ninja reads their build log (another ninja rebuilds them).",
                      f'export PATH={shlex.quote(self.bin_dir)}:"$PATH"']
        for setting in self.exported():
            why = "DeepSpeed's accelerator of the hardware profile" if self.template and setting.name == "DS_ACCELERATOR" \
                else setting.why
            lines += [f"# {why}", setting.export()]
        lines += ["", 'launcher="${1-}"', "shift || true",
                  "# Options before the script are the launcher's (e.g. deepspeed --no_local_rank; --flag=value form).",
                  "options=()", 'while [ $# -gt 0 ] && [[ "$1" == -* ]]; do options+=("$1"); shift; done']
        if self.program:  # script mode: the tuned script's own command unless another is given
            lines += [f"[ $# -gt 0 ] || set -- {self.train()}"]
        lines += ['set -- ${options[@]+"${options[@]}"} "$@"', 'case "$launcher" in']
        lines += [f'  {name}) {self._forwarded() if name == "deepspeed" else ""}exec {form} "$@" ;;'
                  for name, form in self.launchers().items()]
        lines += [f'  *) echo "usage: bash $0 {"|".join(self.launchers())} train.py [arguments]" >&2; exit 2 ;;',
                  "esac"]
        return "\n".join(lines) + "\n"

    def _forwarded(self) -> str:
        """Over several machines, DeepSpeed's launcher starts the others' ranks over ssh with only the variables of
        a few prefixes (its runner's EXPORT_ENVS: MLFLOW, PYTHON, MV2, UCX, NCCL) and those of a `.deepspeed_env` (in
        ~ and ., or the file DS_ENV_FILE names): so the exported settings go into such a file, after the user's own
        .deepspeed_env lines, and DS_ENV_FILE names it (shell text before the launcher; '' on one machine)."""
        if self.nodes == 1 or not self.exported():
            return ""
        lines = " ".join(shlex.quote(f"{s.name}={s.value}") for s in self.exported())
        return ('env_file="$(mktemp)"; { for f in ~/.deepspeed_env ./.deepspeed_env; do [ ! -f "$f" ] || awk NF "$f"; '
                f"done; printf '%s\\n' {lines}; }} > \"$env_file\"; export DS_ENV_FILE=\"$env_file\"; ")

    def _notes(self) -> list[str]:
        notes = []
        if self.stack == "trainer":
            notes.append("# The flags are recommended_trainer_args.json (HfArgumentParser); a script that loads the file "
                         "takes none.")
        if self.stack == "accelerate":
            notes.append("# torchrun and deepspeed: only with DeepSpeedPlugin(hf_ds_config=...) in the script (report.md).")
        notes.append(f"# DeepSpeed's launcher passes --local_rank=N to the script: `bash {LAUNCH_FILE} deepspeed "
                     "--no_local_rank ...` if it takes none.")
        if self.nodes > 1:
            notes.append("# Several machines: torchrun on each (NODE_RANK, MASTER_ADDR); DeepSpeed's launcher on "
                         "machine 0 starts the others over ssh, with the settings below written to the file DS_ENV_FILE "
                         "names (after your ~/.deepspeed_env and ./.deepspeed_env lines).")
            if self.nodes * self.per_node != self.processes:
                notes.append(f"# {self.processes} processes do not split evenly over {self.nodes} machines: "
                             "the launchers start the same number on each.")
        return notes

    def commands(self) -> list[str]:
        """What the file runs, written out: the exports, then each launcher's command."""
        path = [] if self.template else [f'export PATH={shlex.quote(self.bin_dir)}:"$PATH"']
        lines = [*path, *(s.export() for s in self.exported())]
        forms = self.launchers()
        for i, name in enumerate(forms):
            lines += (["# or"] if i else []) + [f"{forms[name]} {self.train()}"]
        return lines

    def console_lines(self, path: str) -> list[str]:
        names = list(self.launchers())
        script = self.train() if self.program else "train.py"
        first = (f"launch: bash {path} {names[0]} {script} (or {' | '.join(names[1:])}): "
                 f"{counted(self.processes, 'process', 'processes')} "
                 + ("(a template: " + self.template + ")" if self.template else "with the trials' environment")
                 + "; `python train.py` alone fails (DeepSpeed needs a launcher)")
        set_ = ", ".join(f"{s.name}={s.value}" for s in self.exported() if s.name != "TORCH_EXTENSIONS_DIR")
        if self.template:
            return [first, f"  it sets {set_ or 'nothing'}: the Python environment, ops folder and threads are the target's "
                           "to set"]
        extensions = self.env().get("TORCH_EXTENSIONS_DIR")
        ops = ("DeepSpeed's ops as the tuner built them: your run reuses them, no rebuild" if ops_built(extensions)
               else UNBUILT)
        return [first, f"  it sets TORCH_EXTENSIONS_DIR={extensions} ({ops}), {set_}, and the tuner's Python first on "
                       f"PATH ({self.bin_dir})"]
