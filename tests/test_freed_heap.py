"""What a load frees goes back to the system (fedllm.common.heap): glibc keeps freed blocks in the process, which
counted ~500 MiB beside Gemma 3 270M's weights after its GGUF load (docs/memory.md)."""

import subprocess
import sys

import pytest

PROBE = """
import fedllm.common.heap as heap

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

start = rss_mib()
blocks, kept = [], []
for _ in range(3200):  # 200 MiB of heap blocks (below glibc's mmap threshold), each followed by a small one kept:
    blocks.append(bytearray(64 * 1024))  # freed, they are holes inside the heap that free() cannot give back
    kept.append(bytearray(200))
del blocks
freed = rss_mib()
heap.give_back_freed_heap()
print(freed - start, rss_mib() - start)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_blocks_go_back_to_the_system():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    kept_by_free, kept_after = map(float, out.stdout.split())
    assert kept_by_free > 100  # of the 200 MiB freed, free() alone left most in the process
    assert kept_after < 40  # ... and they went back


def test_a_loaded_base_gives_back_what_its_load_freed(monkeypatch):
    from fedllm.models import loading
    from fedllm.recipe.schema import ModelConfig

    calls = []
    monkeypatch.setattr(loading, "give_back_freed_heap", lambda: calls.append("trim"))
    cfg = ModelConfig(name="tiny-llama")
    model = loading.load_base_model(cfg, loading.load_tokenizer(cfg))
    assert model is not None and calls == ["trim"]
