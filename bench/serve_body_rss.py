"""Peak RSS of `fedllm serve` while a 64 MiB chunked request body (no Content-Length) arrives.

    python bench/serve_body_rss.py [--serve-module PATH]

``--serve-module`` loads another version of ``fedllm/commands/serve.py`` (e.g. ``git show <rev>:fedllm/commands/serve.py >
/tmp/old_serve.py``) to compare. Prints the answer's status and the process's peak RSS before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "evaluation"), str(ROOT)]


def main() -> None:
    import httpx
    from conftest import _train_tokenizer  # the evaluation tests' tiny tokenizer
    from evalkit import LoopbackServer, tiny_llama_config
    from transformers import LlamaForCausalLM

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve-module", default=None)
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    if args.serve_module:
        spec = importlib.util.spec_from_file_location("other_serve", args.serve_module)
        serve = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(serve)
    else:
        import fedllm.commands.serve as serve
    tok = _train_tokenizer()
    model = LlamaForCausalLM(tiny_llama_config(tok))

    def rss() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def body():
        for _ in range(args.mib):
            yield b" " * (1 << 20)

    with LoopbackServer(serve.build_app(model, tok, "tiny", max_new_tokens_limit=4)) as srv:
        before = rss()
        try:
            status = httpx.post(f"{srv.base_url}/chat/completions", content=body(), timeout=120,
                                headers={"content-type": "application/json"}).status_code
        except httpx.TransportError as e:
            status = type(e).__name__
        print(f"status {status}; peak RSS {before:.0f} MiB -> {rss():.0f} MiB")


if __name__ == "__main__":
    main()
