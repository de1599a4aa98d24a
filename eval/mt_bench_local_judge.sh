#!/usr/bin/env bash
# bash eval/mt_bench_local_judge.sh CHECKPOINT JUDGE_MODEL [PORT] [extra `fedllm eval` flags...]
#
# Serves JUDGE_MODEL (a checkpoint, exported model, preset or hub id) with `fedllm serve` on
# 127.0.0.1, evaluates CHECKPOINT on MT-Bench with it as the judge, and stops the server.
# A small local judge gives rough numbers only; the paper's numbers use GPT-4.
set -euo pipefail
checkpoint=$1
judge=$2
port=${3:-8765}
shift $(( $# < 3 ? $# : 3 ))

fedllm serve "$judge" --host 127.0.0.1 --port "$port" --model-name local-judge &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT

python - "$port" <<'PY'
import sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/v1/models"
for _ in range(300):
    try:
        urllib.request.urlopen(url, timeout=2)
        sys.exit(0)
    except OSError:
        time.sleep(1)
sys.exit("the judge server did not come up")
PY

fedllm eval "$checkpoint" --tasks mt_bench \
    --judge-base-url "http://127.0.0.1:$port/v1" --judge-model local-judge "$@"
