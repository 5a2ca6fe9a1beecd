"""Predicted vs measured peak memory of script-mode trials of three unchanged user scripts, before and after
calibration.

Scripts (run as users wrote them, through `autotune trial --script`, one rank, DeepSpeed's CPU accelerator):
- plain DeepSpeed: tests/scripts/mha_gpt_train.py (issue 18's script: `nn.MultiheadAttention` with a causal mask
  and its default `need_weights=True`, so an eager attention), at sequence 512 where the s^2 term matters;
- Hugging Face Trainer: examples/train_hf.py (GPT-2 built from a config, SDPA);
- Accelerate: tests/scripts/accelerate_loop_train.py (its own DataLoader, `accelerator.accumulate`);
- and issue 18's script as filed (tests/scripts/plain_ds_train.py: MHA with `need_weights=False`, so SDPA),
  whose first predictions ran 31-38% over.
Per trial: the measured whole-process peak, the estimator's prediction for the model the trial showed (the
shape autotune.script.inspect_model derives, attention included) before calibration, and after calibration
on the other trials of the same script (leave-one-out: autotune.prediction.calibrate.fit_calibration, as a sweep does
after its first trials). For the eager script, the same two predictions with the attention assumed fused
(the estimator before the attention was inspected) show what the attention term changes.

    OMP_NUM_THREADS=1 python benchmarks/script_memory.py            # run the trials (~10-15 min on 2 cores)
    python benchmarks/script_memory.py --reuse                      # analyse the committed results again
    OMP_NUM_THREADS=1 python benchmarks/script_memory.py --missing  # add the trials of scripts not yet run

Writes benchmarks/results/script_memory.jsonl (the trials), script_memory.json and script_memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from autotune.prediction.calibrate import fit_calibration
from autotune.prediction.estimate import estimate
from autotune.values.hardware import PROFILES, Hardware
from autotune.values.results import TrialResult
from autotune.script.inspect_model import shape_from_info
from autotune.values.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MiB = 2**20
HF_FLAGS = "--use_cpu true --report_to none --save_strategy no --disable_tqdm true"
# (name, script, its arguments ({out}: a scratch directory), --global-batch or None (the script's), configs)
SCRIPTS: list[dict[str, Any]] = [
    {"name": "plain DeepSpeed (MHA, eager)", "script": "tests/scripts/mha_gpt_train.py",
     "args": "--deepspeed --deepspeed_config tests/scripts/plain_ds_config.json --steps 24 --hidden 128 --layers 4 "
             "--heads 8 --seq-len 512 --vocab 2048",
     "global_batch": 4, "configs": [(0, 1), (0, 2), (0, 4), (2, 4)]},
    {"name": "plain DeepSpeed (issue 18's script as filed, MHA need_weights=False: SDPA)",
     "script": "tests/scripts/plain_ds_train.py",
     "args": "--deepspeed --deepspeed_config tests/scripts/plain_ds_config.json --steps 24",
     "global_batch": 4, "configs": [(0, 1), (0, 2), (0, 4)]},
    {"name": "HF Trainer (GPT-2, SDPA)", "script": "examples/train_hf.py",
     "args": f"--deepspeed examples/ds_config_hf.json --output_dir {{out}} --max_steps 10 {HF_FLAGS} --layers 4 "
             "--hidden 128 --heads 8 --seq_len 256 --vocab 2048",
     "global_batch": None, "configs": [(0, 2), (0, 4), (0, 8), (2, 8)]},
    {"name": "Accelerate loop", "script": "tests/scripts/accelerate_loop_train.py",
     "args": "--ds-config tests/scripts/accelerate_loop_config.json --batch-size 4 --steps 40 --seq-len 256",
     "global_batch": None, "configs": [(1, 2), (1, 4), (1, 8), (2, 8)]},
]


def run_trial(spec: dict[str, Any], stage: int, micro: int, scratch: Path) -> dict[str, Any]:
    run_dir = scratch / f"{Path(spec['script']).stem}-z{stage}-mb{micro}"
    args = spec["args"].format(out=scratch / "out")
    command = [sys.executable, "-m", "autotune.cli", "trial", "--script", spec["script"], "--script-args", args,
               "--zero-stage", str(stage), "--micro-batch", str(micro), "--precision", "bf16",
               "--run-dir", str(run_dir), "--json"]
    if spec["global_batch"]:
        command += ["--global-batch", str(spec["global_batch"])]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    try:
        printed = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"script": spec["name"], "error": (done.stderr or done.stdout)[-2000:]}
    return {"script": spec["name"], "result": printed["result"], "model": printed["model"]}


def workload_of(row: dict[str, Any]) -> Workload:
    model = row["model"]
    shape = shape_from_info(model, model.get("seq_len"), f"{Path(row['result']['script']).stem}:{model['class']}")
    return Workload(shape, int(row["result"]["global_batch"]), 1)


def fused(workload: Workload) -> Workload:
    """The same workload with the attention the estimator assumed before it was inspected (fused SDPA)."""
    return replace(workload, model=replace(workload.model, attention="sdpa", attention_dropout=False))


PREDICTIONS = ("before", "loo", "first")  # uncalibrated; leave-one-out; calibrated on the first trial only


def predictions(rows: list[dict[str, Any]], hardware: Hardware, shape_of=workload_of) -> list[dict[str, int | None]]:
    """Per row, the predicted peak: uncalibrated (`before`), calibrated on the script's other trials (`loo`,
    leave-one-out), and calibrated on its first trial only (`first`: the smallest micro-batch, as a sweep after
    its first trial; none for that trial itself)."""
    results = [TrialResult.from_dict(r["result"]) for r in rows]
    out = []
    for i, result in enumerate(results):
        workload = shape_of(rows[i])
        loo = fit_calibration(results[:i] + results[i + 1:], workload, hardware)
        first = fit_calibration(results[:1], workload, hardware) if i else None
        out.append({"before": estimate(result.config, workload, hardware).peak_bytes,
                    "loo": estimate(result.config, workload, hardware, loo).peak_bytes,
                    "first": estimate(result.config, workload, hardware, first).peak_bytes if first else None})
    return out


def pct(predicted: int, measured: int) -> float:
    return 100.0 * (predicted - measured) / measured


def analyse(rows: list[dict[str, Any]], hardware: Hardware) -> dict[str, Any]:
    scripts = []
    for spec in SCRIPTS:
        ok = [r for r in rows if r["script"] == spec["name"] and r.get("result", {}).get("status") == "ok"]
        ok.sort(key=lambda r: (r["result"]["config"]["micro_batch"], r["result"]["config"]["zero_stage"]))
        failed = [r for r in rows if r["script"] == spec["name"] and r not in ok]
        variants = {"inspected": predictions(ok, hardware)}
        if any(workload_of(r).model.attention != "sdpa" for r in ok):
            variants["fused"] = predictions(ok, hardware, lambda r: fused(workload_of(r)))
        table = []
        for i, r in enumerate(ok):
            measured = int(r["result"]["peak_memory_bytes"])
            config = r["result"]["config"]
            row: dict[str, Any] = {"config": f"z{config['zero_stage']} mb{config['micro_batch']} bf16",
                                   "global_batch": r["result"]["global_batch"], "measured_mib": measured / MiB}
            for variant, predicted in variants.items():
                for kind in PREDICTIONS:
                    value = predicted[i][kind]
                    row[f"{variant}_{kind}_mib"] = value / MiB if value is not None else None
                    row[f"{variant}_{kind}_error_pct"] = pct(value, measured) if value is not None else None
            table.append(row)
        model = ok[0]["model"] if ok else {}
        summary = {f"{variant}_{kind}": statistics.median(abs(t[f"{variant}_{kind}_error_pct"]) for t in table
                                                          if t[f"{variant}_{kind}_error_pct"] is not None)
                   for variant in variants for kind in PREDICTIONS if len(table) > 1}
        scripts.append({"name": spec["name"], "script": spec["script"], "args": spec["args"],
                        "global_batch_flag": spec["global_batch"], "variants": list(variants),
                        "model": {k: model.get(k) for k in ("class", "params", "layers", "hidden", "heads", "seq_len",
                                                            "attention", "attention_source", "attention_dropout",
                                                            "tied_embeddings", "dtype")},
                        "trials": table, "failed": [r.get("error") or r["result"].get("error") for r in failed],
                        "median_abs_error_pct": summary})
    return {"machine": f"{platform.node()} ({os.cpu_count()} cores)", "hardware_profile": hardware.name,
            "command": "OMP_NUM_THREADS=1 python benchmarks/script_memory.py", "scripts": scripts}


LABELS = {"before": "before calibration", "loo": "calibrated on the others", "first": "calibrated on the first"}


def markdown(data: dict[str, Any]) -> str:
    lines = ["# Peak memory of script-mode trials: predicted vs measured (unchanged scripts)", "",
             f"`{data['command']}` on {data['machine']}; one rank, DeepSpeed's CPU accelerator, bf16, the "
             f"`{data['hardware_profile']}` profile. Measured: the trial's whole-process peak (VmHWM). Predicted, "
             "for the model the trial showed (autotune.script.inspect_model's shape, attention included): before "
             "calibration; calibrated on the script's other trials (leave-one-out, autotune.prediction.calibrate); calibrated "
             "on its first trial only (the smallest micro-batch, as a sweep is after its first trial). Where the "
             "attention is not fused, the same with the attention assumed fused (the estimator before the "
             "attention was inspected). Error = (predicted - measured) / measured.", ""]
    overview = ["## Medians of the absolute errors", "", "| script | " + " | ".join(LABELS.values()) + " |",
                "| --- |" + " --- |" * len(LABELS)]
    body: list[str] = []
    for s in data["scripts"]:
        m = s["model"]
        if not s["trials"]:
            body += [f"## {s['name']}", "", f"No trial ran: {s['failed']}", ""]
            continue
        for variant in s["variants"]:
            med = s["median_abs_error_pct"]
            name = s["name"] + (" - attention assumed fused" if variant == "fused" else "")
            overview.append(f"| {name} | " + " | ".join(f"{med[f'{variant}_{k}']:.1f}%" for k in LABELS) + " |")
        body += [f"## {s['name']}", "", f"`{s['script']} {s['args']}`"
                 + (f" with `--global-batch {s['global_batch_flag']}`" if s["global_batch_flag"] else ""), "",
                 f"Model seen: {m['class']}, {m['params']:,} parameters, {m['layers']} layers, hidden {m['hidden']}, "
                 f"{m['heads']} heads, sequence {m['seq_len']}; attention {m['attention'] or 'sdpa (assumed)'} "
                 f"(from {m['attention_source'] or '-'}), tied embeddings {m['tied_embeddings']}, dtype {m['dtype']}.",
                 ""]
        cols = [(v, k) for v in s["variants"] for k in LABELS]
        head = "| config | global batch | measured MiB | " + " | ".join(
            f"{'fused: ' if v == 'fused' else ''}{LABELS[k]} MiB (error)" for v, k in cols) + " |"
        body += [head, "|" + " --- |" * (head.count("|") - 1)]
        for t in s["trials"]:
            cells = [f"{t[f'{v}_{k}_mib']:.0f} ({t[f'{v}_{k}_error_pct']:+.1f}%)" if t[f"{v}_{k}_mib"] is not None
                     else "-" for v, k in cols]
            body.append(f"| {t['config']} | {t['global_batch']} | {t['measured_mib']:.0f} | " + " | ".join(cells) + " |")
        if s["failed"]:
            body.append(f"\nFailed trials: {len(s['failed'])} ({'; '.join(str(f)[:200] for f in s['failed'])})")
        body.append("")
    return "\n".join(lines + overview + [""] + body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reuse", action="store_true", help="analyse benchmarks/results/script_memory.jsonl again")
    parser.add_argument("--missing", action="store_true",
                        help="run only the scripts that script_memory.jsonl has no trials of, and add them")
    args = parser.parse_args()
    raw = RESULTS / "script_memory.jsonl"
    rows = [json.loads(line) for line in raw.read_text().splitlines() if line.strip()] \
        if (args.reuse or args.missing) else []
    if not args.reuse:
        done = {r["script"] for r in rows}
        with tempfile.TemporaryDirectory(prefix="script-memory-") as tmp:
            for spec in (s for s in SCRIPTS if s["name"] not in done):
                for stage, micro in spec["configs"]:
                    row = run_trial(spec, stage, micro, Path(tmp))
                    status = row.get("result", {}).get("status", "error")
                    peak = row.get("result", {}).get("peak_memory_bytes") or 0
                    print(f"{spec['name']}: z{stage} mb{micro}: {status}, peak {peak / MiB:.0f} MiB", flush=True)
                    rows.append(row)
        raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = analyse(rows, PROFILES["cpu"])
    (RESULTS / "script_memory.json").write_text(json.dumps(data, indent=1) + "\n")
    text = markdown(data)
    (RESULTS / "script_memory.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
