"""FlowerTune's four challenge recipes (recipes/flowertune/) and the communication budget they carry.

Expected values are FlowerTune's (flwrlabs/flower examples/flowertune-llm-*/pyproject.toml and README) and byte
counts worked out by hand from the models' shapes; MB is FlowerTune's ``1024**2`` bytes.
"""

import json
import logging

import pytest

from fedllm.commands.cli import main
from fedllm.recipe.checks import load_recipe, parse_recipe

MB = 1024**2

#: challenge -> (hub data set, clients = num-supernodes, clients sampled a round = fraction-train x clients)
CHALLENGES = {
    "general-nlp": ("flwrlabs/alpaca-gpt4", 20, 2),
    "finance": ("flwrlabs/fingpt-sentiment-train", 50, 5),
    "medical": ("flwrlabs/medical-meadow-medical-flashcards", 20, 2),
    "code": ("flwrlabs/code-alpaca-20k", 10, 2),
}
MODELS = {"mistral-7b": ("mistralai/Mistral-7B-v0.3", "4bit-flowertune"), "smollm2-135m": ("smollm2-135m-instruct", "none")}


def lora_bytes(layers, hidden, q_out, v_out, r=32):
    """fp32 bytes of r-32 LoRA factors on q_proj and v_proj: A (r x hidden) and B (out x r) of each, every layer."""
    return 4 * layers * (r * hidden + q_out * r + r * hidden + v_out * r)


# Mistral-7B-v0.3: 32 layers, hidden 4096, 8 KV heads of 128 (v_proj 4096 -> 1024)
MISTRAL_CLIENT_BYTES = lora_bytes(32, 4096, 4096, 1024)
# SmolLM2-135M: 30 layers, hidden 576, 3 KV heads of 64 (v_proj 576 -> 192)
SMOLLM2_CLIENT_BYTES = lora_bytes(30, 576, 576, 192)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("challenge", sorted(CHALLENGES))
def test_flowertune_recipe_has_the_challenge_settings(challenge, model):
    recipe = load_recipe(f"recipes/flowertune/{model}-{challenge}-fedavg.yaml", check_files=False)
    data, clients, sampled = CHALLENGES[challenge]
    assert (recipe.model.name, recipe.model.quantization) == MODELS[model]
    assert (recipe.lora.r, recipe.lora.alpha, recipe.lora.dropout) == (32, 64, 0.075)
    assert recipe.lora.target_modules == ["q_proj", "v_proj"]
    assert recipe.data.path == data and recipe.federation.partition.method == "iid"
    fed, train = recipe.federation, recipe.train
    assert (fed.num_clients, recipe.sampled_per_round(), fed.rounds, fed.strategy) == (clients, sampled, 200, "fedavg")
    assert fed.fraction == (0.2 if challenge == "code" else 0.1)
    assert fed.communication_budget_mb == 200_000
    assert (train.local_steps, train.batch_size, train.grad_accum, train.max_length) == (10, 16, 1, 512)
    assert (train.lr, train.min_lr, train.lr_schedule) == (5e-5, 1e-6, "cosine")
    assert recipe.data.template == ("flowertune_input" if challenge in ("finance", "code") else "flowertune")


def test_flowertune_budget_arithmetic_by_hand():
    # 32 x (32*4096 + 4096*32 + 32*4096 + 1024*32) x 4 B = 54,525,952 B = 52 MB per client per direction
    assert MISTRAL_CLIENT_BYTES == 54_525_952 and MISTRAL_CLIENT_BYTES / MB == 52.0
    assert SMOLLM2_CLIENT_BYTES == 7_372_800
    from fedllm.runs.comm_budget import projected_bytes, usage

    # General NLP on Mistral: 2 clients a round, down + up, 200 rounds: 200 x 2 x 2 x 52 MB = 41,600 MB
    total = projected_bytes(2 * MISTRAL_CLIENT_BYTES, 2 * MISTRAL_CLIENT_BYTES, 200)
    assert total / MB == 41_600.0
    assert usage(total, 200_000.0) == {"total_bytes": total, "total_mb": 41_600.0, "mb_unit_bytes": MB,
                                       "budget_mb": 200_000.0, "budget_share": 0.208, "within_budget": True}
    assert usage(total, None) == {"total_bytes": total, "total_mb": 41_600.0, "mb_unit_bytes": MB}
    over = usage(projected_bytes(5 * MISTRAL_CLIENT_BYTES, 5 * MISTRAL_CLIENT_BYTES, 400), 100_000.0)
    assert over["total_mb"] == 208_000.0 and over["within_budget"] is False and over["budget_share"] == 2.08


@pytest.mark.parametrize("challenge", sorted(CHALLENGES))
def test_flowertune_recipe_dry_run_offline_projects_the_budget(challenge, capsys, monkeypatch):
    """Mistral's weights and the hub data are absent offline: the dry run says what it would load and projects the
    run's bytes from the model's shapes against the 200,000 MB budget."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data, _, sampled = CHALLENGES[challenge]
    assert main(["train", f"recipes/flowertune/mistral-7b-{challenge}-fedavg.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "model (mistralai/Mistral-7B-v0.3) built on the meta device" in out and "weights absent" in out
    assert f"the data set {data}" in out
    assert f"down 52.000 MB ({MISTRAL_CLIENT_BYTES:,} B), up 52.000 MB ({MISTRAL_CLIENT_BYTES:,} B)" in out
    total_mb = 200 * 2 * sampled * MISTRAL_CLIENT_BYTES / MB
    per_dir = sampled * 52
    assert (f"communication for the whole run: {total_mb:,.2f} MB (MB = 1024**2 bytes) = 200 rounds x "
            f"(up {per_dir:,.3f} + down {per_dir:,.3f} MB); {100 * total_mb / 200_000:.2f}% of the budget of "
            "200,000 MB") in out
    assert "warning:" not in out


def test_flowertune_budget_dry_run_warns_when_over(capsys, monkeypatch):
    """FlowerTune's tracker warns (it does not stop) past its budget; so does the dry run, with exit 0."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["train", "recipes/flowertune/mistral-7b-finance-fedavg.yaml", "--dry-run",
                 "federation.communication_budget_mb=50000"]) == 0
    out = capsys.readouterr().out
    assert "104,000.00 MB" in out and "208.00% of the budget of 50,000 MB" in out
    assert "warning: the run would move 104,000.00 MB, over federation.communication_budget_mb (50,000 MB" in out


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_budget_must_be_positive(value, capsys):
    assert main(["train", "recipes/flowertune/mistral-7b-code-fedavg.yaml", "--dry-run",
                 f"federation.communication_budget_mb={value}"]) == 2
    err = capsys.readouterr().err
    assert "federation.communication_budget_mb" in err and "mistral-7b-code-fedavg.yaml" in err


def test_budget_in_summary_of_a_run(tiny_recipe, caplog):
    """summary.json's communication entry: the bytes metrics.jsonl counted, in MB of 1024**2, and the budget's share."""
    from fedllm.engine.server import run

    # tiny LLaMA (2 layers, hidden 64, 2 KV heads of 16), r 4 on q, k, v, o: 2 x (2 x (4*64 + 64*4) + 2 x (4*64 + 32*4))
    # = 3,584 parameters, 14,336 fp32 bytes per client per direction; 2 clients, 2 rounds
    per_client = 4 * 2 * (2 * (4 * 64 + 64 * 4) + 2 * (4 * 64 + 32 * 4))
    total = 2 * 2 * 2 * per_client
    budget = 0.1  # MB: the run's 0.109375 MB is over it
    raw = tiny_recipe(federation={"communication_budget_mb": budget})
    with caplog.at_level(logging.WARNING, logger="fedllm"):
        result = run(parse_recipe(raw))
    summary = json.loads((result.run_dir / "summary.json").read_text())
    rounds = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    counted = sum(r["bytes_up_total"] + r["bytes_down_total"] for r in rounds if r.get("round", 0) > 0)
    assert counted == total == 114_688
    assert summary["communication"] == {"total_bytes": total, "total_mb": 0.109375, "mb_unit_bytes": MB,
                                        "budget_mb": budget, "budget_share": 1.09375, "within_budget": False}
    assert "over federation.communication_budget_mb" in caplog.text
    from fedllm.runs.comm_budget import summary_line

    assert summary_line(summary["communication"]) == ("communication: 0.11 MB up + down (MB = 1024**2 bytes), "
                                                      "109.38% of the budget of 0.1 MB")


def test_flowertune_prompt_templates_match_flowertune_formatting():
    """FlowerTune's formatting_prompts_func text: '{head}\\n### Instruction:\\n{instruction}\\n### Response: {response}'
    with instruction = instruction + ' ' + input for finance and code (the space stays when input is empty)."""
    from fedllm.data.templates import format_prompt
    from fedllm.recipe.schema import DataConfig

    head = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
    record = {"instruction": "Classify the sentiment.", "input": "Shares rose 5%.", "output": "positive"}
    general = DataConfig(path="x", template="flowertune")
    assert format_prompt(record, general) == f"{head}\n### Instruction:\nClassify the sentiment.\n### Response: "
    joined = DataConfig(path="x", template="flowertune_input")
    assert format_prompt(record, joined) == (f"{head}\n### Instruction:\nClassify the sentiment. Shares rose 5%.\n"
                                             "### Response: ")
    assert format_prompt({**record, "input": ""}, joined) == (f"{head}\n### Instruction:\nClassify the sentiment. \n"
                                                              "### Response: ")
    medical = DataConfig(path="x", template="flowertune", fields={"instruction": "input"})
    flashcard = {"instruction": "Answer this question truthfully", "input": "What is X?", "output": "Y."}
    assert format_prompt(flashcard, medical) == f"{head}\n### Instruction:\nWhat is X?\n### Response: "


@pytest.mark.parametrize("records,clients", [(52_002, 20), (1_003, 50), (97, 10)])
def test_flowertune_recipe_iid_split_equals_flwr_datasets(records, clients):
    """FlowerTune's clients: flwr-datasets' FederatedDataset(shuffle=True, seed=42) shuffles with datasets'
    Dataset.shuffle(seed=42), then IidPartitioner takes Dataset.shard(num_shards, index, contiguous=True). The
    recipes' seed 42 makes fedllm's iid partitioner give every client the same records (checked against datasets)."""
    import datasets

    from fedllm.data.partition import partition_records

    recipe = load_recipe("recipes/flowertune/mistral-7b-general-nlp-fedavg.yaml", check_files=False)
    assert recipe.seed == 42 and recipe.federation.partition.method == "iid"
    shuffled = datasets.Dataset.from_dict({"row": list(range(records))}).shuffle(seed=42)
    flower = [sorted(shuffled.shard(num_shards=clients, index=k, contiguous=True)["row"]) for k in range(clients)]
    fedllm = partition_records([{}] * records, clients, recipe.seed, recipe.federation.partition)
    assert fedllm == flower


@pytest.mark.parametrize("recipe_path,progress", [
    ("recipes/flowertune/mistral-7b-finance-fedavg.yaml", lambda t, total: t / total),        # server_round 1..T
    ("recipes/fedllm_bench/llama2-7b-fedaya-fedavg.yaml", lambda t, total: (t - 1) / total),  # round 0..T-1
])
def test_flowertune_and_fedllm_bench_lr_schedules(recipe_path, progress):
    """FlowerTune's cosine_annealing(server_round, T, max, min) and OpenFedLLM / FedLLM-Bench's
    cosine_learning_rate(round, T, lr, min): min + 0.5 (max - min)(1 + cos(pi x progress)), written out here."""
    import math

    from fedllm.engine.server import round_lr

    r = load_recipe(recipe_path, check_files=False)
    lr, low, total = r.train.lr, r.train.min_lr, r.federation.rounds
    for t in (1, 2, total // 2, total - 1, total):
        expected = low + 0.5 * (lr - low) * (1 + math.cos(math.pi * progress(t, total)))
        assert round_lr(r, t) == pytest.approx(expected, rel=1e-12, abs=0)


@pytest.mark.parametrize("challenge", sorted(CHALLENGES))
def test_flowertune_smollm2_recipe_budget_projection(challenge, meta_costs):
    """SmolLM2-135M variants (its 30 layers built on the meta device): 7,372,800 B per client per direction."""
    from fedllm.runs.comm_budget import projection_lines

    costs = meta_costs(f"recipes/flowertune/smollm2-135m-{challenge}-fedavg.yaml")
    sampled = CHALLENGES[challenge][2]
    assert set(costs.comm.up.values()) == set(costs.comm.down.values()) == {SMOLLM2_CLIENT_BYTES}
    assert costs.comm.round_up == costs.comm.round_down == sampled * SMOLLM2_CLIENT_BYTES
    total_mb = 200 * 2 * sampled * SMOLLM2_CLIENT_BYTES / MB  # general NLP: 28,125 MB
    per_dir = sampled * SMOLLM2_CLIENT_BYTES / MB
    expected = (f"  communication for the whole run: {total_mb:,.2f} MB (MB = 1024**2 bytes) = 200 rounds x "
                f"(up {per_dir:,.3f} + down {per_dir:,.3f} MB); {100 * total_mb / 200_000:.2f}% of the budget of "
                "200,000 MB")
    assert projection_lines(costs.comm.round_up, costs.comm.round_down, 200, 200_000.0) == [expected]
