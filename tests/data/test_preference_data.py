"""data.format: preference — every record form gives the prompt/chosen/rejected tokens trl's DPOTrainer gives.

The expectation is trl 1.16's own tokenisation (``DPOTrainer._prepare_dataset``: prompt extraction, EOS for
text, chat template for conversations, answers cut where the prompt's tokens diverge) of the same record, or of
the conversational form the record stands for (HH-RLHF dialogues), never fedllm's code.
"""

from __future__ import annotations

import json
import types

import pytest

from fedllm.data.errors import DataError
from fedllm.data.formats import make_encoder
from fedllm.data.tokens import IGNORE_INDEX
from fedllm.recipe.schema import DataConfig

pytest.importorskip("trl")


def trl_tokens(tokenizer, record: dict, max_length: int = 512) -> tuple[list[int], list[int], list[int]]:
    """trl's (prompt_ids, chosen_ids, rejected_ids) of ``record``."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir="unused", report_to=[], max_length=max_length, use_cpu=True)
    out = DPOTrainer._prepare_dataset(
        types.SimpleNamespace(_tokenizer=tokenizer), Dataset.from_list([record]), tokenizer, args, "test"
    )[0]
    return out["prompt_ids"], out["chosen_ids"], out["rejected_ids"]


def fedllm_tokens(tokenizer, record: dict, max_length: int = 512, **data) -> tuple[list[int], list[int], list[int]]:
    """fedllm's example of ``record`` split back into (prompt, chosen, rejected) ids."""
    ex = make_encoder(tokenizer, DataConfig(format="preference", **data), max_length)(record)
    n = sum(label == IGNORE_INDEX for label in ex["labels"])
    assert ex["labels"][:n] == [IGNORE_INDEX] * n and ex["rejected_labels"][:n] == [IGNORE_INDEX] * n
    assert ex["input_ids"][:n] == ex["rejected_input_ids"][:n]
    assert ex["labels"][n:] == ex["input_ids"][n:] and ex["rejected_labels"][n:] == ex["rejected_input_ids"][n:]
    return ex["input_ids"][:n], ex["input_ids"][n:], ex["rejected_input_ids"][n:]


USER = [{"role": "user", "content": "hello world"}]
GOOD = [{"role": "assistant", "content": "the cat sat on the mat."}]
BAD = [{"role": "assistant", "content": "the dog is bad."}]


def test_preference_strings_match_trl(tokenizer):
    record = {"prompt": "the cat sat", "chosen": " on the mat.", "rejected": " the dog is good."}
    ours = fedllm_tokens(tokenizer, record, template="plain")
    assert ours == trl_tokens(tokenizer, record)
    assert ours[1][-1] == tokenizer.eos_token_id  # text answers end with EOS, as trl's


def test_preference_conversational_matches_trl(tokenizer):
    record = {"prompt": USER, "chosen": GOOD, "rejected": BAD}
    assert fedllm_tokens(tokenizer, record) == trl_tokens(tokenizer, record)


def test_preference_whole_conversations_extract_the_shared_turns_as_trl(tokenizer):
    record = {"chosen": USER + GOOD, "rejected": USER + BAD}
    assert fedllm_tokens(tokenizer, record) == trl_tokens(tokenizer, record)
    # UltraFeedback-binarized: a prompt string beside whole conversations (trl extracts from the answers)
    assert fedllm_tokens(tokenizer, {"prompt": "hello world", **record}) == trl_tokens(tokenizer, record)


def test_preference_string_prompt_with_answer_turns_is_a_user_turn(tokenizer):
    record = {"prompt": "hello world", "chosen": GOOD, "rejected": BAD}
    assert fedllm_tokens(tokenizer, record) == trl_tokens(tokenizer, {"prompt": USER, "chosen": GOOD, "rejected": BAD})


HH = {
    "chosen": "\n\nHuman: hello world\n\nAssistant: the cat\n\nHuman: and the dog?\n\nAssistant: the dog is good.",
    "rejected": "\n\nHuman: hello world\n\nAssistant: the cat\n\nHuman: and the dog?\n\nAssistant: bad dog",
}


def test_preference_hh_dialogues_plain_split_as_trl_extract_prompt(tokenizer):
    assert fedllm_tokens(tokenizer, HH, template="plain") == trl_tokens(tokenizer, HH)


def test_preference_hh_dialogues_parse_into_turns_for_a_chat_template(tokenizer):
    turns = [
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "the cat"},
        {"role": "user", "content": "and the dog?"},
    ]
    conversational = {
        "prompt": turns,
        "chosen": [{"role": "assistant", "content": "the dog is good."}],
        "rejected": [{"role": "assistant", "content": "bad dog"}],
    }
    assert fedllm_tokens(tokenizer, HH) == trl_tokens(tokenizer, conversational)


def test_preference_fields_mapping_and_alpaca_template(tokenizer):
    record = {"question": "Add 2 and 3.", "good": "5", "bad": "6"}
    fields = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    alpaca = (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nAdd 2 and 3.\n\n### Response:\n"
    )
    expected = trl_tokens(tokenizer, {"prompt": alpaca, "chosen": "5", "rejected": "6"})
    assert fedllm_tokens(tokenizer, record, template="alpaca", fields=fields) == expected


def test_preference_truncation_and_long_prompt_match_trl(tokenizer):
    record = {"prompt": "the cat sat on the mat. " * 3, "chosen": "the dog is good. " * 4, "rejected": "bad"}
    p, c, r = trl_tokens(tokenizer, record)
    cut = len(p) + 5  # the chosen answer is cut, the rejected one is not
    assert len(c) > 5 > len(r) - 1
    ours = make_encoder(tokenizer, DataConfig(format="preference", template="plain"), cut)(record)
    assert ours["input_ids"] == (p + c)[:cut] and ours["rejected_input_ids"] == (p + r)[:cut]
    assert make_encoder(tokenizer, DataConfig(format="preference", template="plain"), len(p))(record) is None


def test_preference_multi_turn_prompt_needs_a_chat_template(tokenizer):
    with pytest.raises(DataError, match="single user turn"):
        make_encoder(tokenizer, DataConfig(format="preference", template="alpaca"), 64)(HH)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_preference_bad_records_are_counted_per_client(tokenizer, tmp_path):
    from fedllm.data.federated import build_federated_data
    from fedllm.recipe.schema import PartitionConfig

    rows = [{"prompt": f"the cat {i}", "chosen": "the mat", "rejected": "the dog"} for i in range(8)]
    rows[1]["chosen"] = "  "  # empty answer
    rows[2]["rejected"] = rows[2]["chosen"]  # identical
    rows[3]["prompt"] = "the cat sat on the mat. " * 20  # prompt alone over max_length
    path = _write(tmp_path / "p.jsonl", rows)
    cfg = DataConfig(path=str(path), format="preference", template="plain", cache=False)
    data = build_federated_data(cfg, PartitionConfig(method="iid"), 2, tokenizer, 48, 0)
    counts = data.manifest["bad_records"]["counts"]
    total = {k: sum(c[k] for c in counts.values()) for k in ("empty", "identical", "too_long", "kept")}
    assert total == {"empty": 1, "identical": 1, "too_long": 1, "kept": 5}
    with pytest.raises(DataError, match=r"p.jsonl: record \d \(client \d\): (a required text is empty|the chosen and)"):
        build_federated_data(
            DataConfig(path=str(path), format="preference", template="plain", cache=False, on_bad_record="error"),
            PartitionConfig(method="iid"),
            2,
            tokenizer,
            48,
            0,
        )


def test_preference_user_keyed_json_partitions_naturally(tokenizer, tmp_path):
    from fedllm.data.federated import build_federated_data
    from fedllm.recipe.schema import PartitionConfig

    users = {
        "alice": [{"prompt": "the cat", "chosen": "sat", "rejected": "the dog"}] * 3,
        "bob": [{"prompt": "hello", "chosen": "world", "rejected": "bad"}] * 2,
    }
    path = tmp_path / "by_client.json"
    path.write_text(json.dumps(users))
    cfg = DataConfig(path=str(path), format="preference", template="plain", cache=False)
    data = build_federated_data(cfg, PartitionConfig(method="natural", column="user"), 2, tokenizer, 64, 0)
    histograms = sorted(sorted(e["label_histogram"].items()) for e in data.manifest["clients"].values())
    assert histograms == [[("alice", 3)], [("bob", 2)]]
    assert sorted(len(c) for c in data.clients) == [2, 3]


def test_preference_recipe_checks_refuse_what_cannot_hold(tmp_path):
    from fedllm.recipe.checks import parse_recipe
    from fedllm.recipe.schema import RecipeError

    base = {
        "output_dir": str(tmp_path / "r"),
        "data": {"path": "x.jsonl", "format": "preference"},
        "federation": {"num_clients": 2, "strategy": "frlora"},
        "train": {"local_steps": 1, "objective": "dpo"},
    }

    def problems(**train) -> dict:
        raw = json.loads(json.dumps(base))
        for key, value in train.items():
            section, _, name = key.partition("__")
            raw.setdefault(section, {})[name] = value
        try:
            parse_recipe(raw, "r.yaml")
        except RecipeError as e:
            return {k: exp for k, _, exp in e.problems}
        return {}

    assert problems() == {}
    assert "precomputed" in problems(train__preference={"reference": "adapter_disabled"})["train.preference.reference"]
    assert problems(privacy__mechanism="dp_sgd", privacy__noise_multiplier=1.0) == {}  # clipped per pair
    ghost = problems(privacy__mechanism="dp_sgd", privacy__noise_multiplier=1.0, privacy__grad_sample_mode="ghost")
    assert "hooks with train.objective: dpo" in ghost["privacy.grad_sample_mode"]
    assert (
        "0 for loss: sigmoid"
        in problems(train__preference={"label_smoothing": 0.1})["train.preference.label_smoothing"]
    )
    assert "positive" in problems(train__preference={"beta": 0})["train.preference.beta"]
    assert "dpo with data.format: preference" in problems(train__objective="sft")["train.objective"]
    assert problems(train__preference={"loss": "robust", "label_smoothing": 0.2}) == {}


def test_preference_arith_pairs_reject_a_wrong_result_in_the_same_words(tmp_path):
    import re
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "data_prep" / "make_arith_preferences.py"
    main = runpy.run_path(str(script))["main"]
    for out in ("a", "b"):
        assert main(["--out", str(tmp_path / out), "--train", "60", "--test", "20"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "a" / "train.jsonl").read_text().splitlines()]
    assert (tmp_path / "a" / "train.jsonl").read_bytes() == (tmp_path / "b" / "train.jsonl").read_bytes()
    ops = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y, "/": lambda x, y: x // y}
    for r in rows:
        x, op, y, good = re.search(r"(\d+) ([-+*/]) (\d+) = (\d+)", r["answer"]).groups()
        bad = re.search(r"\d+ [-+*/] \d+ = (\d+)", r["rejected"]).group(1)
        assert int(good) == ops[op](int(x), int(y)) and int(bad) != int(good)
        assert r["answer"].endswith(f"#### {good}") and r["rejected"].endswith(f"#### {bad}")
        assert re.sub(r"\d+", "N", r["answer"]) == re.sub(r"\d+", "N", r["rejected"])  # only the number differs


def test_preference_turns_are_read_as_chat_turns_but_need_string_content():
    """One reader of a conversation turn (fedllm.data.chat.turn_message) for chat and preference records: both
    take OpenAI and ShareGPT keys; a chat turn's number becomes text, a preference answer's is refused."""
    from fedllm.data.chat import turn_message
    from fedllm.data.errors import DataError

    assert turn_message({"from": "gpt", "value": 5}, "chat turn 0") == {"role": "assistant", "content": "5"}
    assert turn_message({"role": "user", "content": "2+3?"}, "chosen: turn 0", string_only=True) == \
        {"role": "user", "content": "2+3?"}
    with pytest.raises(DataError, match=r"chosen: turn 1 needs a role/from in .* and a string content/value"):
        turn_message({"role": "assistant", "content": 5}, "chosen: turn 1", string_only=True)
    with pytest.raises(DataError, match=r"chat turn 2 needs a role/from"):
        turn_message({"speaker": "x", "content": "hi"}, "chat turn 2")
