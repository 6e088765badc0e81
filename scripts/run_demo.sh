#!/usr/bin/env bash
# The main job end to end on the embedded demo corpus, from a fresh clone, with no network data:
# install -> generate the demo corpus + tokenizer + shards -> train -> quantize + export -> evaluate.
# Prints val_bpb next to the source's true entropy and the artifact size. Extra arguments are
# config overrides, e.g. `scripts/run_demo.sh train.time_budget_s=30`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -r requirements.txt
if [ -z "${OMP_NUM_THREADS:-}" ]; then  # the cores free now: a busy core slows every thread that waits for it
    OMP_NUM_THREADS=$(python3 -c "from training.distributed import free_cpu_threads; print(free_cpu_threads())")
    export OMP_NUM_THREADS
    echo "run_demo.sh: OMP_NUM_THREADS=$OMP_NUM_THREADS (the cores free on this machine now; set it to choose)"
fi
[ -f runs/demo/data/manifest.json ] || python3 -m data.demo --out runs/demo/data
python3 train.py --config configs/demo.toml "$@"
