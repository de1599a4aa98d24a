"""``python -m fedllm.flower.server_task``: one ServerApp task, started by fedllm's SuperLink runner
(:func:`fedllm.flower.runtime.serve_serverapps`)."""

import argparse
import sys

from fedllm.flower.runtime import run_server_task

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runtime-api-address", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--root-certificates")
    parser.add_argument("--node-keys")
    args = parser.parse_args()
    sys.exit(run_server_task(args.runtime_api_address, args.token, args.root_certificates, args.node_keys))
