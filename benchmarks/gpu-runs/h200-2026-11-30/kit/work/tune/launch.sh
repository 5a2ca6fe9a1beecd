#!/usr/bin/env bash
# ds-autotune: z0 mb2 ck0 bf16 for llama-1b, global batch 32 on 1 process, in the environment the tuner gives its trials here.
# `python train.py` alone fails: DeepSpeed needs a launcher's RANK, WORLD_SIZE and MASTER_ADDR/PORT
# (without them it looks for MPI: No module named 'mpi4py'). Launch your script with one of:
#   bash launch.sh torchrun train.py
#   bash launch.sh deepspeed train.py
# DeepSpeed's launcher passes --local_rank=N to the script: `bash launch.sh deepspeed --no_local_rank ...` if it takes none.
set -euo pipefail

# The tuner's Python environment first, as its trials had it: its torch built the ops below and its
# ninja reads their build log (another ninja rebuilds them).
export PATH=/opt/torch/.venv/bin:"$PATH"
# DeepSpeed's C++ ops as the tuner built them: loaded, not rebuilt (minutes)
export TORCH_EXTENSIONS_DIR=/root/.cache/ds-autotune/torch_extensions/.venv-5c353192e55d
# DeepSpeed's accelerator of the trials
export DS_ACCELERATOR=cuda
# OpenMP threads per rank, as the trials' ranks had them
export OMP_NUM_THREADS=16
# the CUDA archs of the ops' build, as DeepSpeed's op builder parses them
export TORCH_CUDA_ARCH_LIST=9.0
# the allocator's settings of the trials
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

launcher="${1-}"
shift || true
# Options before the script are the launcher's (e.g. deepspeed --no_local_rank; --flag=value form).
options=()
while [ $# -gt 0 ] && [[ "$1" == -* ]]; do options+=("$1"); shift; done
set -- ${options[@]+"${options[@]}"} "$@"
case "$launcher" in
  torchrun) exec torchrun --nnodes 1 --nproc_per_node 1 "$@" ;;
  deepspeed) exec deepspeed --num_gpus 1 "$@" ;;
  *) echo "usage: bash $0 torchrun|deepspeed train.py [arguments]" >&2; exit 2 ;;
esac
