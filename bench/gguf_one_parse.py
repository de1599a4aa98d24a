"""What a GGUF parse costs, and a first load (tokenizer, config, weights) with and without
``fedllm.models.gguf_cache.one_parse_per_file``: CPU-seconds and parses, side by side, interleaved.

    python bench/gguf_one_parse.py [--trials 2] [--presets smollm2-135m-instruct gemma3-270m]

Each first load converts into a fresh temporary cache (``FEDLLM_CACHE_DIR``), so every load converts the GGUF.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def first_load(name: str, scoped: bool) -> tuple[float, int]:
    """CPU-seconds and GGUF parses of a first load of preset ``name`` (tokenizer, then model)."""
    import contextlib

    import gguf

    from fedllm.models import gguf_cache
    from fedllm.models.loading import load_base_model, load_tokenizer
    from fedllm.recipe.schema import ModelConfig

    parses = []
    real = gguf.GGUFReader

    def counted(path, *args, **kwargs):
        parses.append(path)
        return real(path, *args, **kwargs)

    gguf.GGUFReader = counted
    cfg = ModelConfig(name=name, dtype="fp32")
    try:
        with tempfile.TemporaryDirectory() as cache:
            os.environ["FEDLLM_CACHE_DIR"] = cache
            start = time.process_time()
            with gguf_cache.one_parse_per_file() if scoped else contextlib.nullcontext():
                tok = load_tokenizer(cfg)
                load_base_model(cfg, tok)
            return time.process_time() - start, len(parses)
    finally:
        gguf.GGUFReader = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--presets", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gguf

    from fedllm.models.loading import model_presets

    for name in args.presets:
        directory, file = model_presets.get(name).location()
        before, start = rss_mb(), time.process_time()
        reader = gguf.GGUFReader(str(Path(directory) / file))
        print(f"{name}: one parse {time.process_time() - start:.1f} CPU-s, +{rss_mb() - before:.0f} MB RSS, "
              f"{len(reader.fields)} fields, {len(reader.tensors)} tensors")
        del reader
        rows = {False: [], True: []}
        for _ in range(args.trials):
            for scoped in (False, True):
                rows[scoped].append(first_load(name, scoped))
        for scoped, runs in rows.items():
            cpu = sorted(c for c, _ in runs)[len(runs) // 2]
            print(f"  first load {'with' if scoped else 'without'} one_parse_per_file: median {cpu:.1f} CPU-s, "
                  f"{runs[0][1]} parses")
        ratio = sorted(c for c, _ in rows[True])[args.trials // 2] / sorted(c for c, _ in rows[False])[args.trials // 2]
        print(f"  ratio with/without: {ratio:.2f}")


if __name__ == "__main__":
    main()
