"""DoRA (``lora.use_dora``) with the strategies that merge into the base, keep pieces or keep private state
(FedEx-LoRA, FLoRA, FlexLoRA, mFedLoRU, pFedLoRU, FedSA-LoRA, FedLoRA-PFL, pFL^MF): one round recomputed by hand in
float64 from the uploads the server received (the layer function ``m ⊙ V / ‖V‖_c`` of Liu et al. 2024, Eq. 5, with
the directions ``V`` each strategy defines), the merged and adapter exports against the run's own model and that
oracle, the personal models, PEFT's own DoRA of a nested mFedLoRU client, and pFedLoRU on the Flower apps.
"""

import pytest
import torch
from strategy_helpers import effective_weights, make_raw, make_strategy

from fedllm.common.registry import strategies
from fedllm.engine.server import run
from fedllm.export import export
from fedllm.export.errors import ExportInputError
from fedllm.export.inference import model_from_checkpoint
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies.residual import adapter_layers

MAGNITUDE = ".lora_magnitude_vector."
IDS = torch.tensor([[1, 60, 77, 267, 315, 303, 374, 278, 36]])


def dora_weight(v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """DoRA's weight ``m ⊙ V / ‖V‖_c`` (each output row of ``V`` scaled to norm ``m``), float64."""
    v = v.double()
    return m.double()[:, None] * v / v.norm(dim=1, keepdim=True)


def magnitude_key(layer) -> str:
    return layer.a_key.replace(".lora_A.default.weight", ".lora_magnitude_vector.default.weight")


def layers_of(strategy) -> dict:
    """The strategy's adapter layers (``layers``, or a private-adapter strategy's ``private_layers``)."""
    return getattr(strategy, "layers", None) or strategy.private_layers


def record_last_round(monkeypatch, strategy_cls) -> dict:
    """Patch ``strategy_cls.aggregate``: keep the last round's received state, uploads (copies), example counts and
    every layer's base weight as it was before the round's merges (the strategy's ``layers``)."""
    seen: dict = {}
    original = strategy_cls.aggregate

    def spy(self, rnd, global_state, updates):
        seen.update(rnd=rnd, sent={k: v.clone() for k, v in global_state.items()},
                    uploads=[({k: v.clone() for k, v in u.state.items()}, u.num_examples, u.client_id) for u in updates],
                    base={n: layer.base.weight.detach().clone() for n, layer in layers_of(self).items()})
        return original(self, rnd, global_state, updates)

    monkeypatch.setattr(strategy_cls, "aggregate", spy)
    return seen


def mean_of_products(layer, seen, factors):
    """``W + Σ_k p_k·s·B_k A_k`` (FedEx-LoRA's exact aggregate, FLoRA's stack) from the uploads."""
    total = sum(n for _, n, _ in seen["uploads"])
    v = seen["base"][layer.name].double()
    for state, n, cid in seen["uploads"]:
        b, a = factors(layer, state, cid)
        v = v + (n / total) * layer.scale * (b @ a)
    return v


def product_of_means(layer, seen, factors):
    """``W + s·B̄Ā`` with ``(B̄, Ā)`` the example-weighted means (FedLoRU's merge, τ = 1)."""
    total = sum(n for _, n, _ in seen["uploads"])
    b_bar = sum((n / total) * factors(layer, s, cid)[0] for s, n, cid in seen["uploads"])
    a_bar = sum((n / total) * factors(layer, s, cid)[1] for s, n, cid in seen["uploads"])
    return seen["base"][layer.name].double() + layer.scale * (b_bar @ a_bar)


def uploaded(layer, state, cid):
    return state[layer.b_key].double(), state[layer.a_key].double()


def nested_rebuilt(strategy, sent):
    """mFedLoRU's client factors rebuilt by hand (Alg. 3): ``B + α·Bd Bu``, ``A + α·Ad Au`` for nested clients."""
    def factors(layer, state, cid):
        if layer.b_key in state:
            return uploaded(layer, state, cid)
        part = {p: state[f"{layer.name}.mfedloru.{p}"].double() for p in ("a_down", "a_up", "b_down", "b_up")}
        alpha = strategy.nested_scale
        return (sent[layer.b_key].double() + alpha * part["b_down"] @ part["b_up"],
                sent[layer.a_key].double() + alpha * part["a_down"] @ part["a_up"])
    return factors


MERGE_CASES = {
    "fedex_lora": ({}, mean_of_products),
    "flexlora": ({"client_ranks": [4, 2, 1]}, mean_of_products),
    "flora": ({"client_ranks": [2, 4, 1]}, mean_of_products),
    "mfedloru": ({"tau": 1, "client_ranks": [4, 2, 1]}, product_of_means),
    "pfedloru": ({"tau": 1, "personal_r": 2, "personal_steps": 1, "global_steps": 2}, product_of_means),
}


@pytest.mark.parametrize("strategy", sorted(MERGE_CASES))
def test_dora_merging_strategy_round_replays_in_float64_and_exports(strategy, data_files, tmp_path, monkeypatch):
    """After the last round every layer computes ``m̄ ⊙ V / ‖V‖_c`` with ``m̄`` the example-weighted mean of the
    uploaded magnitudes and ``V`` the strategy's merged direction, recomputed from the uploads and the base before
    the round (float64, 1e-5); the merged export gives the run's logits and that oracle's weights."""
    args, direction = MERGE_CASES[strategy]
    cls = strategies.get(strategy)
    seen = record_last_round(monkeypatch, cls)
    raw = make_raw(data_files, tmp_path / "run", strategy, args, lora={"use_dora": True})
    result = run(parse_recipe(raw))
    assert seen["rnd"] == 2
    model, _, restored, _ = model_from_checkpoint(result.run_dir)
    live, got = effective_weights(result.model), effective_weights(model)
    factors = nested_rebuilt(restored, seen["sent"]) if strategy == "mfedloru" else uploaded
    if strategy == "mfedloru":  # a nested client is among the round's
        assert any(".mfedloru." in k for state, _, _ in seen["uploads"] for k in state)
    if strategy in ("flora", "flexlora"):  # the round's clients have different ranks
        assert len({next(v.shape for k, v in state.items() if ".lora_A." in k) for state, _, _ in seen["uploads"]}) == 2
    total = sum(n for _, n, _ in seen["uploads"])
    oracle = {}
    for name, layer in restored.layers.items():
        key = magnitude_key(layer)
        magnitudes = [state[key].double() for state, _, _ in seen["uploads"]]
        assert not torch.equal(magnitudes[0], magnitudes[1])  # the clients trained m differently
        m_bar = sum((n / total) * m for m, (_, n, _) in zip(magnitudes, seen["uploads"], strict=True))
        oracle[name] = dora_weight(direction(layer, seen, factors), m_bar)
        assert (got[name].double() - oracle[name]).abs().max() <= 1e-5, name
        assert torch.equal(live[name], got[name]), name  # the checkpoint rebuilds the live model
        merged_into_base = not torch.allclose(seen["base"][name], layer.base.weight)
        assert merged_into_base == (strategy != "flexlora")  # FlexLoRA keeps ΔW in pieces, not in the base
    with torch.no_grad():
        run_logits = model(input_ids=IDS).logits
    out = export(result.run_dir, "merged", tmp_path / "merged", client="global").out
    assert_merged_export(out, run_logits, oracle)
    if strategy == "flexlora":  # ΔW in the clients' pieces: a DoRA adapter of rank Σ r_k on the original base
        assert_stacked_adapter_export(result.run_dir, tmp_path, run_logits, seen)
    if strategy == "pfedloru":  # client 0's personal model adds its private s_p·L_0·U_0 after the DoRA layer
        personal, _, _, _ = model_from_checkpoint(result.run_dir, client=0)
        entry = result.clients.get(0)
        for name, weight in oracle.items():
            private = personal.get_submodule(name).pfedloru
            product = private.scale * entry[f"{name}.pfedloru.L"].double() @ entry[f"{name}.pfedloru.U"].double()
            assert product.abs().max() > 1e-6
            oracle[name] = weight + product
        assert_personal_export(result.run_dir, tmp_path, personal, oracle)


def assert_stacked_adapter_export(run_dir, tmp_path, run_logits, seen):
    """FlexLoRA's DoRA adapter export: rank = the round's Σ r_k, loads with peft on the original base, gives the
    run's logits (1e-5)."""
    import json

    from peft import PeftModel

    from fedllm.models.loading import load_base_model, load_tokenizer
    from fedllm.recipe.schema import ModelConfig

    out = export(run_dir, "adapter", tmp_path / "adapter").out
    config = json.loads((out / "adapter_config.json").read_text())
    ranks = sum(next(v.shape[0] for k, v in state.items() if ".lora_A." in k) for state, _, _ in seen["uploads"])
    assert config["use_dora"] is True and config["r"] == config["lora_alpha"] == ranks
    original = load_base_model(ModelConfig(name="tiny-llama"), load_tokenizer(ModelConfig(name="tiny-llama")),
                               num_labels=2, seed=0)
    loaded = PeftModel.from_pretrained(original, str(out)).eval()
    with torch.no_grad():
        assert (loaded(input_ids=IDS).logits - run_logits).abs().max() <= 1e-5


def assert_merged_export(out, run_logits, oracle):
    """The merged export loads with transformers alone, gives ``run_logits`` and the oracle's weights (1e-5)."""
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        assert (merged(input_ids=IDS).logits - run_logits).abs().max() <= 1e-5
    for name, weight in oracle.items():
        plain = merged.get_submodule(name.removeprefix("base_model.model.")).weight
        assert (plain.double() - weight).abs().max() <= 1e-5, name


def assert_personal_export(run_dir, tmp_path, personal, oracle, refusal="DoRA's column norm"):
    """Client 0's personal model equals the oracle, its merged export too; its adapter export is refused."""
    got = effective_weights(personal)
    for name, weight in oracle.items():
        assert (got[name].double() - weight).abs().max() <= 1e-5, name
    with torch.no_grad():
        logits = personal(input_ids=IDS).logits
    assert_merged_export(export(run_dir, "merged", tmp_path / "personal", client=0).out, logits, oracle)
    with pytest.raises(ExportInputError, match=refusal):
        export(run_dir, "adapter", tmp_path / "personal-adapter", client=0)


def test_dora_fedsa_lora_keeps_the_magnitude_private_beside_b(data_files, tmp_path, monkeypatch):
    """FedSA-LoRA under DoRA: neither B nor m is uploaded or downloaded; the global model keeps m = ‖W‖_c (the base
    model); client k's model is ``m_k ⊙ (W + s·B_k Ā) / ‖·‖_c`` (float64 oracle from its stored B_k, m_k and the
    averaged A); its merged export gives its logits and the oracle; its adapter export loads with peft."""
    from peft import PeftModel

    from fedllm.models.loading import load_base_model, load_tokenizer
    from fedllm.recipe.schema import ModelConfig

    seen = record_last_round(monkeypatch, strategies.get("fedsa_lora"))
    raw = make_raw(data_files, tmp_path / "run", "fedsa_lora", {}, lora={"use_dora": True},
                   federation={"clients_per_round": 3})
    result = run(parse_recipe(raw))
    layers = adapter_layers(result.model)
    private = {k for layer in layers.values() for k in (layer.b_key, magnitude_key(layer))}
    assert all(not (set(state) & private) for state, _, _ in seen["uploads"])
    a_bytes = sum(v.numel() * 4 for k, v in result.global_state.items() if ".lora_A." in k)  # all that travels
    assert all(set(h["bytes_up"].values()) == set(h["bytes_down"].values()) == {a_bytes} for h in result.history)
    total = sum(n for _, n, _ in seen["uploads"])
    for name, layer in layers.items():
        norms = layer.base.weight.double().norm(dim=1)  # PEFT's init of m: the base's row norms
        assert (result.global_state[magnitude_key(layer)].double() - norms).abs().max() <= 1e-6
        a_bar = sum((n / total) * state[layer.a_key].double() for state, n, _ in seen["uploads"])
        assert (result.global_state[layer.a_key].double() - a_bar).abs().max() <= 1e-6
    for client in (0, 2):
        entry = result.clients.get(client)
        personal, _, _, _ = model_from_checkpoint(result.run_dir, client=client)
        got = effective_weights(personal)
        oracle = {}
        for name, layer in layers.items():
            m = entry[magnitude_key(layer)]
            assert (m.double() - layer.base.weight.double().norm(dim=1)).abs().max() > 1e-6  # m_k trained
            v = layer.base.weight.double() + layer.scale * entry[layer.b_key].double() @ result.global_state[
                layer.a_key].double()
            oracle[name] = dora_weight(v, m)
            assert (got[name].double() - oracle[name]).abs().max() <= 1e-5, name
        with torch.no_grad():
            logits = personal(input_ids=IDS).logits
        assert_merged_export(export(result.run_dir, "merged", tmp_path / f"m{client}", client=client).out, logits,
                             oracle)
        out = export(result.run_dir, "adapter", tmp_path / f"a{client}", client=client).out
        original = load_base_model(ModelConfig(name="tiny-llama"), load_tokenizer(ModelConfig(name="tiny-llama")),
                                   num_labels=2, seed=0)
        loaded = PeftModel.from_pretrained(original, str(out)).eval()
        with torch.no_grad():
            assert (loaded(input_ids=IDS).logits - logits).abs().max() <= 1e-5


@pytest.mark.parametrize("shared", ["lora", "full"])
def test_dora_fedlora_pfl_shares_the_magnitude_with_sigma(shared, data_files, tmp_path, monkeypatch):
    """FedLoRA-PFL under DoRA: m is part of the shared σ (trained in σ's phase, averaged with eq. 8's plain mean);
    the global layer is ``m̄ ⊙ V̄ / ‖V̄‖_c`` (``shared: lora``: ``V̄ = W + s·B̄Ā``; ``full``: ``V̄`` = the mean of the
    uploaded weights), client k's model adds its private ``τ_k = L_k U_k`` after it (float64 oracle, 1e-5); the
    personal merged export gives its logits and the oracle; its adapter export is refused."""
    seen = record_last_round(monkeypatch, strategies.get("fedlora_pfl"))
    raw = make_raw(data_files, tmp_path / "run", "fedlora_pfl", {"shared": shared, "e_lora": 1, "e_global": 2},
                   lora={"use_dora": True})
    result = run(parse_recipe(raw))
    model, _, restored, _ = model_from_checkpoint(result.run_dir)
    got, k = effective_weights(model), len(seen["uploads"])
    entry = result.clients.get(0)
    oracle = {}
    for name, layer in adapter_layers(model).items():
        mean = {key: sum(state[key].double() for state, _, _ in seen["uploads"]) / k
                for key in (magnitude_key(layer), layer.a_key, layer.b_key, layer.base_key) if key in seen["uploads"][0][0]}
        assert magnitude_key(layer) in mean and (layer.base_key in mean) == (shared == "full")
        v = mean[layer.base_key] if shared == "full" else (
            seen["base"][name].double() + layer.scale * mean[layer.b_key] @ mean[layer.a_key])
        oracle[name] = dora_weight(v, mean[magnitude_key(layer)])
        assert (got[name].double() - oracle[name]).abs().max() <= 1e-5, name
        tau = getattr(layer.module, restored.private_attr).scale * (
            entry[f"{name}.fedlora.L"].double() @ entry[f"{name}.fedlora.U"].double())
        assert tau.abs().max() > 1e-6
        oracle[name] = oracle[name] + tau
    personal, _, _, _ = model_from_checkpoint(result.run_dir, client=0)
    assert_personal_export(result.run_dir, tmp_path, personal, oracle,
                           "merged its updates" if shared == "full" else "private adapter .* outside DoRA's column norm")


@torch.no_grad()
def test_dora_mfedloru_nested_client_computes_peft_dora_of_its_rebuilt_factors():
    """A nested mFedLoRU client's layer (hooks on lora_A / lora_B, which PEFT's DoRA also calls for its column norm)
    computes PEFT's DoRA of ``(B + α·Bd Bu, A + α·Ad Au)`` written into the adapter, and the float64 oracle."""
    from fedllm.models.loading import load_model, write_state
    from fedllm.recipe.schema import LoraConfig, ModelConfig

    model = load_model(ModelConfig(name="tiny-llama"), LoraConfig(r=4, alpha=8, use_dora=True), num_labels=2,
                       seed=0).model.eval()
    strategy = make_strategy("mfedloru", model, client_ranks=[2, 4, 4], tau=1)
    gen = torch.Generator().manual_seed(7)
    params = dict(model.named_parameters())
    state = {k: 0.1 * torch.randn(params[k].shape, generator=gen) for k in strategy.nested_keys}
    for layer in strategy.layers.values():  # a trained global adapter and magnitude
        for key in (layer.a_key, layer.b_key):
            state[key] = 0.1 * torch.randn(params[key].shape, generator=gen)
        state[magnitude_key(layer)] = params[magnitude_key(layer)] * (1 + 0.1 * torch.rand(params[magnitude_key(layer)].shape, generator=gen))
    write_state(model, state)
    nested = effective_weights(model)
    rebuilt = nested_rebuilt(strategy, state)
    plain = {}
    for name, layer in strategy.layers.items():
        b, a = rebuilt(layer, {k: v for k, v in state.items() if ".mfedloru." in k}, 0)
        plain[layer.b_key], plain[layer.a_key] = b.float(), a.float()
        oracle = dora_weight(layer.base.weight.double() + layer.scale * b @ a, state[magnitude_key(layer)])
        assert (nested[name].double() - oracle).abs().max() <= 1e-5, name
    strategy.clear_nested()
    write_state(model, plain)
    peft = effective_weights(model)
    assert all((peft[n] - nested[n]).abs().max() <= 1e-6 for n in nested)


def test_dora_pfedloru_on_flower_matches_the_simulation(data_files, tmp_path, monkeypatch):
    """pFedLoRU under DoRA over the Flower apps (loopback grid, real ClientApp): the global adapter with its averaged
    magnitudes, the server's merged base, every node's replayed base and its client's private factors equal the
    simulation's (tol 0)."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedllm.flower.executor import FlowerExecutor
    from tests.test_flower_apps import LoopbackGrid, assert_close, node_state, nodes, parts

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    raw = make_raw(data_files, tmp_path / "sim", "pfedloru", MERGE_CASES["pfedloru"][0], lora={"use_dora": True})
    sim = run(parse_recipe(raw))
    grid = LoopbackGrid(nodes(tmp_path, 3))
    flower = run(parse_recipe({**raw, "output_dir": str(tmp_path / "flower")}), executor=FlowerExecutor(grid))
    expected, got = parts(sim.run_dir), parts(flower.run_dir)
    assert any(MAGNITUDE in k for k in expected["adapter"])
    assert_close(expected["adapter"], got["adapter"], "global adapter", tol=0)
    assert_close(expected["base"], got["base"], "server base", tol=0)
    for cid in sorted({c for h in sim.history for c in h["clients"]}):
        on_node = node_state(tmp_path, cid)
        assert_close(expected["base"], on_node["base"], f"base on node {cid}", tol=0)
        sim_entry = {k.split("/", 1)[1]: v for k, v in expected["clients"].items() if k.startswith(f"client{cid}/")}
        assert_close(sim_entry, {k.split("/", 1)[1]: v for k, v in on_node["clients"].items()}, f"client {cid}", tol=0)


def test_dora_pflmf_personal_model_is_u_v_with_its_magnitudes_and_exports(data_files, tmp_path):
    """pFL^MF under DoRA: client k's model is θ_k = U v_k (A, B and every magnitude sliced from it in
    ``named_parameters`` order), each layer ``m ⊙ (W + s·B A) / ‖·‖_c`` (float64 oracle, 1e-5); its merged export
    gives its logits and the oracle, its adapter export loads with peft on the original base."""
    from peft import PeftModel

    from fedllm.models.loading import load_base_model, load_tokenizer
    from fedllm.recipe.schema import ModelConfig
    from fedllm.strategies.pflmf import U_KEY, V_KEY

    raw = make_raw(data_files, tmp_path / "run", "pflmf", {"rank": 3, "eta_u": 0.5}, lora={"use_dora": True},
                   train={"optimizer": "sgd"})
    result = run(parse_recipe(raw))
    personal, _, strategy, _ = model_from_checkpoint(result.run_dir, client=0)
    theta = result.global_state[U_KEY].double() @ result.clients.get(0)[V_KEY].double()
    sliced, at = {}, 0
    for name, p in personal.named_parameters():
        if any(name == s.name for s in strategy.slices):
            sliced[name], at = theta[at:at + p.numel()].view(p.shape), at + p.numel()
    assert at == theta.numel()
    got, oracle = effective_weights(personal), {}
    for name, layer in adapter_layers(personal).items():
        m = sliced[magnitude_key(layer)]
        assert (m - layer.base.weight.double().norm(dim=1)).abs().max() > 1e-6  # the magnitude moved with v
        oracle[name] = dora_weight(layer.base.weight.double() + layer.scale * sliced[layer.b_key] @ sliced[layer.a_key], m)
        assert (got[name].double() - oracle[name]).abs().max() <= 1e-5, name
    with torch.no_grad():
        logits = personal(input_ids=IDS).logits
    assert_merged_export(export(result.run_dir, "merged", tmp_path / "merged", client=0).out, logits, oracle)
    out = export(result.run_dir, "adapter", tmp_path / "adapter", client=0).out
    original = load_base_model(ModelConfig(name="tiny-llama"), load_tokenizer(ModelConfig(name="tiny-llama")),
                               num_labels=2, seed=0)
    with torch.no_grad():
        assert (PeftModel.from_pretrained(original, str(out)).eval()(input_ids=IDS).logits - logits).abs().max() <= 1e-5
