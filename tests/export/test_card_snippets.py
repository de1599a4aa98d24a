"""The usage snippet of an exported card runs as written and gives the run's model.

Both snippets run in the export tests' one fresh reload process (:func:`exportkit.reload_plain`), each in a
namespace of its own: the merged card's with transformers alone (before peft or fedllm is imported), the
adapter card's (a tiny preset: fedllm rebuilds the base) then compared with the merged export.
"""

from exportkit import card_snippet


def test_adapter_card_of_a_tiny_preset_runs_as_written(cases):
    fedavg = cases["fedavg"]
    adapter = fedavg.dirs["adapter/global"]
    code = card_snippet(adapter)
    assert "path/to" not in code and str(adapter.resolve()) in code
    got = fedavg.meta["snippets"]["adapter"]
    assert "error" not in got, got["error"]
    name, diff = got["result"]  # its model must match the merged export loaded with plain transformers
    assert name.startswith("PeftModel") and diff < 1e-4


def test_merged_card_runs_as_written(cases):
    got = cases["fedavg"].meta["snippets"]["merged"]
    assert "error" not in got, got["error"]
    assert got["result"] == "LlamaForCausalLM" and got["imported"] == []  # plain transformers: no peft, no fedllm


def test_adapter_card_snippet_prints_nothing_on_stderr(cases):
    """Run as a user would (a fresh interpreter, the snippet alone): peft imports bitsandbytes, whose CPU build
    logs "Failed to load CPU gemm_4bit_forward from kernels-community" unless the snippet quiets it."""
    import subprocess
    import sys

    code = card_snippet(cases["fedavg"].dirs["adapter/global"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "", done.stderr
