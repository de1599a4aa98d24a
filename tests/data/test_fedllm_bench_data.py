"""FedLLM-Bench's user-keyed JSON (client -> records) as a natural partition, for single-turn instruction and
multi-turn chat data, and the recipes of recipes/fedllm_bench/.

The fixtures are in FedLLM-Bench's layout (utils/benchmark_dataset.py: ``get_fed_datasets`` builds one client per
value of ``json.load(f)``, each a list of ``{"instruction", "response", ...}``; ``get_multi_turn_dataset`` one per
value, each a list of ``{"conversations": [{"from": "human"|"gpt", "value"}]}``). The expected texts are their
``alpaca_template`` (utils/template.py) and FastChat's ``vicuna_v1.1`` conversation (their data_module.py), written out.
"""

import json

import pytest

from fedllm.data.federated import build_federated_data
from fedllm.recipe.schema import DataConfig, PartitionConfig

HEAD = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
VICUNA = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
          "detailed, and polite answers to the user's questions.")

SINGLE = {
    "u_17": [{"instruction": "the cat sat", "response": "on the mat", "language": "en"},
             {"instruction": "hello", "response": "world", "language": "en"}],
    "u_03": [{"instruction": "the dog", "response": "is good", "language": "en"}],
    "u_42": [{"instruction": "the movie", "response": "was bad", "language": "en"}] * 3,
}
MULTI = {
    "ip_9": [{"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "world"},
                                {"from": "human", "value": "the cat"}, {"from": "gpt", "value": "sat"}]}],
    "ip_1": [{"conversations": [{"from": "human", "value": "the dog"}, {"from": "gpt", "value": "is good"}]}] * 2,
}


def _federate(tmp_path, users, tokenizer, **data):
    path = tmp_path / "by_client.json"
    path.write_text(json.dumps(users, indent=4))
    cfg = DataConfig(path=str(path), cache=False, **data)
    fed = build_federated_data(cfg, PartitionConfig(method="natural", column="user"), len(users), tokenizer, 256, 0)
    return {user: [fed.examples[i] for i in members] for user, members in zip(users, fed.clients, strict=True)}


def _supervised(tokenizer, example):
    return tokenizer.decode([t for t, label in zip(example["input_ids"], example["labels"], strict=True)
                             if label != -100])


def test_fedllm_bench_single_turn_user_keyed_json(tokenizer, tmp_path):
    by_user = _federate(tmp_path, SINGLE, tokenizer, format="instruction", template="openfedllm",
                        fields={"output": "response"})
    assert {u: len(ex) for u, ex in by_user.items()} == {"u_03": 1, "u_17": 2, "u_42": 3}   # one client per user
    first = by_user["u_17"][0]
    text = tokenizer.decode(first["input_ids"])
    assert text == f"<s>{HEAD}\n\n### Instruction:\nthe cat sat \n\n### Response: on the mat</s>"
    assert _supervised(tokenizer, first) == "on the mat</s>"


def test_fedllm_bench_multi_turn_user_keyed_json(tokenizer, tmp_path):
    pytest.importorskip("fastchat")
    by_user = _federate(tmp_path, MULTI, tokenizer, format="chat", template="vicuna_v1.1")
    assert {u: len(ex) for u, ex in by_user.items()} == {"ip_1": 2, "ip_9": 1}
    convo = by_user["ip_9"][0]
    assert tokenizer.decode(convo["input_ids"]) == (f"<s>{VICUNA} USER: hello ASSISTANT: world</s>USER: the cat "
                                                    "ASSISTANT: sat</s>")
    # loss on the assistant turns only; fedllm's chat encoder cuts where FastChat's generation prompt ends
    # ("ASSISTANT:"), so the space before each reply is supervised too (FedLLM-Bench masks "ASSISTANT: " with it)
    assert _supervised(tokenizer, convo) == " world</s> sat</s>"


def test_fedllm_bench_clients_are_numbered_in_file_order(tokenizer, tmp_path):
    """FedLLM-Bench's get_fed_datasets: client k is the k-th key of the file (json.load keeps the file's order), and
    main_*.py trains ``dataset[:num_clients]``: with 2 clients, the first two users. The file's order (u_17, u_03,
    u_42) is not the sorted one, so client 0 must be u_17's."""
    path = tmp_path / "by_client.json"
    path.write_text(json.dumps(SINGLE))
    expected = [[r["instruction"] for r in records] for records in json.loads(path.read_text()).values()]
    assert expected[0] == ["the cat sat", "hello"] and sorted(SINGLE) != list(SINGLE)
    cfg = DataConfig(path=str(path), format="instruction", template="openfedllm", fields={"output": "response"},
                     cache=False)
    for num_clients in (3, 2):
        fed = build_federated_data(cfg, PartitionConfig(method="natural", column="user"), num_clients, tokenizer,
                                   256, 0)
        got = [[tokenizer.decode(fed.examples[i]["input_ids"]).split("### Instruction:\n")[1].split(" \n")[0]
                for i in members] for members in fed.clients]
        assert got == expected[:num_clients]


def test_fedllm_bench_user_count_must_match_num_clients(tokenizer, tmp_path):
    from fedllm.data.partition import PartitionError

    path = tmp_path / "by_client.json"
    path.write_text(json.dumps(SINGLE))
    cfg = DataConfig(path=str(path), format="instruction", template="openfedllm", fields={"output": "response"},
                     cache=False)
    with pytest.raises(PartitionError, match="gives 3 clients .* set federation.num_clients: 3"):
        build_federated_data(cfg, PartitionConfig(method="natural", column="user"), 4, tokenizer, 256, 0)


#: recipe -> (clients, clients per round, rounds, local steps, max length): FedLLM-Bench's training_scripts/*.sh
RECIPES = {
    "llama2-7b-fedaya-fedavg": (38, 4, 200, 10, 1024),
    "llama2-7b-fedchatbotit-fedavg": (237, 10, 100, 5, 1024),
    "llama2-7b-fedwildchat-fedavg": (100, 5, 100, 10, 1024),
    "llama2-7b-fedwildchat-multiturn-fedavg": (50, 3, 100, 10, 2048),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fedllm_bench_recipe_settings(name):
    from fedllm.recipe.checks import load_recipe

    r = load_recipe(f"recipes/fedllm_bench/{name}.yaml", check_files=False)
    clients, per_round, rounds, steps, length = RECIPES[name]
    assert (r.federation.num_clients, r.sampled_per_round(), r.federation.rounds) == (clients, per_round, rounds)
    assert (r.train.local_steps, r.train.max_length, r.train.batch_size, r.train.grad_accum) == (steps, length, 4, 4)
    assert (r.lora.r, r.lora.alpha, r.lora.dropout, r.train.lr, r.train.min_lr) == (16, 32, 0.05, 2e-5, 1e-6)
    assert (r.model.name, r.model.quantization, r.federation.strategy) == ("meta-llama/Llama-2-7b-hf", "8bit", "fedavg")
    assert (r.federation.partition.method, r.federation.partition.column) == ("natural", "user")
    assert (r.data.format, r.data.template) == (("chat", "vicuna_v1.1") if "multiturn" in name else
                                                ("instruction", "openfedllm"))


@pytest.mark.parametrize("pairs", [1, 7, 8, 9, 25, 100])
def test_fedllm_bench_chatbotpa_dpo_recipe_and_dynamic_local_steps(pairs):
    """FedChatbotPA/dpo_all.sh: 747 users, 10 per round, 200 rounds, batch 8 x 1, length 512, lr 1e-4 -> 1e-5;
    --dynamic_local_step is utils.get_dynamic_local_step: ceil(n x 3 / (200 x 10 / 747) / (8 x 1))."""
    import math

    from fedllm.recipe.checks import load_recipe
    from fedllm.recipe.schedule import steps_per_round

    r = load_recipe("recipes/fedllm_bench/llama2-7b-fedchatbotpa-dpo.yaml", check_files=False)
    assert (r.federation.num_clients, r.sampled_per_round(), r.federation.rounds) == (747, 10, 200)
    assert (r.train.batch_size, r.train.grad_accum, r.train.max_length, r.train.lr, r.train.min_lr) == (8, 1, 512, 1e-4, 1e-5)
    assert (r.lora.r, r.lora.alpha, r.train.objective, r.train.preference.beta) == (8, 16, "dpo", 0.1)
    sample_num = 200 * 10 / 747
    assert steps_per_round(r.train, pairs) == math.ceil(pairs * 3 / sample_num / (8 * 1))


def test_fedllm_bench_user_without_records_is_named(caplog):
    from fedllm.data.loading import user_keyed

    with caplog.at_level("INFO", logger="fedllm"):  # an earlier in-process run may have quieted fedllm's logger
        rows = user_keyed({"u_9": [{"instruction": "a"}], "u_2": [], "u_5": [{"instruction": "b"}]})
    assert [r["user"] for r in rows] == ["u_9", "u_5"] and rows.users == ["u_9", "u_2", "u_5"]
    assert "1 user(s) without records ('u_2')" in caplog.text and "(user 'u_2' is client 1)" in caplog.text
    # a record's own user column decides the clients: the keys are no client list then
    assert user_keyed({"u_9": [{"instruction": "a", "user": "x"}], "u_2": []}).users is None


#: SINGLE with FedLLM-Bench users without records, one first and one between (its clients 0 and 2)
WITH_EMPTY = {"u_0": [], "u_17": SINGLE["u_17"], "u_9": [], "u_03": SINGLE["u_03"], "u_42": SINGLE["u_42"]}


def _user_file(tmp_path, users):
    path = tmp_path / "by_client.json"
    path.write_text(json.dumps(users))
    return DataConfig(path=str(path), format="instruction", template="openfedllm", fields={"output": "response"},
                      cache=False)


def test_fedllm_bench_users_without_records_are_clients_numbered_as_there(tokenizer, tmp_path):
    """get_fed_datasets makes an empty Dataset for a user without records and ``dataset[:num_clients]`` keeps it:
    client k is the file's k-th key, an empty user included (sample_num_list [0, 2, 0, 1, 3])."""
    cfg = _user_file(tmp_path, WITH_EMPTY)
    for num_clients in (5, 3):
        fed = build_federated_data(cfg, PartitionConfig(method="natural", column="user"), num_clients, tokenizer,
                                   256, 0)
        got = [[tokenizer.decode(fed.examples[i]["input_ids"]).split("### Instruction:\n")[1].split(" \n")[0]
                for i in members] for members in fed.clients]
        assert got == [[r["instruction"] for r in records] for records in WITH_EMPTY.values()][:num_clients]
        assert [c["size"] for c in fed.manifest["clients"].values()] == [0, 2, 0, 1, 3][:num_clients]
    # a personal test split holds nothing out of an empty client
    fed = build_federated_data(_user_file(tmp_path, {**WITH_EMPTY, "u_03": SINGLE["u_42"]}),
                               PartitionConfig(method="natural", column="user"), 5, tokenizer, 256, 0)
    assert [len(ix) for ix in fed.clients] == [0, 2, 0, 3, 3]


def test_fedllm_bench_users_without_records_only_under_natural_on_user(tokenizer, tmp_path):
    """Only natural on 'user' of a user-keyed JSON has clients without records: natural on another column, iid and
    dirichlet split the records (an empty part stays an error), and the first num_clients users must not all be
    empty."""
    from fedllm.data.partition import PartitionError, partition_records

    cfg = _user_file(tmp_path, WITH_EMPTY)
    fed = build_federated_data(cfg, PartitionConfig(method="natural", column="language"), 1, tokenizer, 256, 0)
    assert [len(ix) for ix in fed.clients] == [6]
    fed = build_federated_data(cfg, PartitionConfig(method="iid"), 3, tokenizer, 256, 0)
    assert [len(ix) for ix in fed.clients] == [2, 2, 2]
    with pytest.raises(PartitionError, match="cannot split 6 examples into 7 clients"):
        build_federated_data(cfg, PartitionConfig(method="iid"), 7, tokenizer, 256, 0)
    with pytest.raises(PartitionError, match="cannot split 6 examples into 7 clients"):
        build_federated_data(cfg, PartitionConfig(method="dirichlet", column="language"), 7, tokenizer, 256, 0)
    with pytest.raises(PartitionError, match="partition method 'iid' has no client values"):
        partition_records([{"user": "a"}], 2, 0, PartitionConfig(method="iid"), values=["a", "b"])
    with pytest.raises(PartitionError, match="none of the first 1 values holds a training record"):
        build_federated_data(cfg, PartitionConfig(method="natural", column="user"), 1, tokenizer, 256, 0)


def test_fedllm_bench_partition_on_disk_keeps_users_without_records(tokenizer, tmp_path):
    """`fedllm partition` writes an empty client file for such a user, and training from its manifest gives the same
    clients; a manifest of another method with an empty client is refused."""
    from fedllm.data.federated import partition_to_disk
    from fedllm.data.manifest import PartitionError, manifest_clients

    cfg = _user_file(tmp_path, WITH_EMPTY)
    natural = PartitionConfig(method="natural", column="user")
    manifest = partition_to_disk(cfg, natural, 5, 0, tmp_path / "parts")
    assert (tmp_path / "parts" / "client_000.jsonl").read_text() == ""
    direct = build_federated_data(cfg, natural, 5, tokenizer, 256, 0)
    again = build_federated_data(cfg, PartitionConfig(path=str(tmp_path / "parts")), 5, tokenizer, 256, 0)
    assert again.clients == direct.clients and [len(ix) for ix in again.clients] == [0, 2, 0, 1, 3]
    with pytest.raises(PartitionError, match="manifest client 0 has no examples"):
        manifest_clients({**manifest, "method": "custom"})


def test_fedllm_bench_recipe_check_counts_users_not_records(tmp_path):
    """The recipe check that refuses more clients than records (before any model loads) lets natural on 'user'
    through: 3 users, one without records, make 3 clients from 2 records."""
    from fedllm.data.federated import split_problems

    cfg = _user_file(tmp_path, {"u_1": SINGLE["u_03"], "u_2": [], "u_3": SINGLE["u_03"]})
    assert split_problems(cfg, PartitionConfig(method="natural", column="user"), 3) == []
    assert [p[0] for p in split_problems(cfg, PartitionConfig(method="iid"), 3)] == ["federation.num_clients"]


def test_fedllm_bench_numbering_survives_the_hold_out(tokenizer, tmp_path):
    """A held-out share (data.eval_fraction) may take all of a user's records: that user stays its client (then
    without records), so client k is still the file's k-th key."""
    users = {f"u_{k}": [{"instruction": f"q{k} {i}", "response": "r"} for i in range(k % 3)] for k in range(9)}
    cfg = _user_file(tmp_path, users)
    cfg.eval_fraction = 0.5
    fed = build_federated_data(cfg, PartitionConfig(method="natural", column="user"), 9, tokenizer, 256, 0)
    assert len(fed.clients) == 9 and sum(len(ix) for ix in fed.clients) == 9 - len(fed.eval_records) == 5
    for k, members in enumerate(fed.clients):
        assert all(f"q{k} " in tokenizer.decode(fed.examples[i]["input_ids"]) for i in members)
    assert sum(1 for ix in fed.clients if not ix) > 3  # (u_0, u_3, u_6 have no records in the file)
