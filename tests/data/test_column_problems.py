"""The recipe's column names and class names against a sample of the data, every problem at once."""

import json

from fedllm.data.loading import local_sample
from fedllm.data.validation import column_problems
from fedllm.recipe.schema import DataConfig, PartitionConfig

RECORDS = [{"sentence": "good film", "sentiment": "pos", "user": "a"},
           {"sentence": "dull", "sentiment": "neg", "user": "b"},
           {"sentence": "fine", "sentiment": "meh", "user": "a"}]


def test_every_column_and_class_name_that_misses_the_data_is_named():
    data = DataConfig(format="classification", fields={"text": "sentence", "label": "sentimnt"}, labels=["pos", "neg"])
    got = column_problems(data, PartitionConfig(method="natural", column="usr"), RECORDS, "d.jsonl")
    have = "a column of d.jsonl (its records have sentence, sentiment, user)"
    assert got == [("data.fields.label", "sentimnt", have + " (did you mean 'sentiment' or 'sentence'?)"),
                   ("federation.partition.column", "usr", have + " (did you mean 'user'?)")]
    data = DataConfig(format="classification", fields={"text": "sentence", "label": "sentiment"}, labels=["pos", "neg"])
    assert column_problems(data, PartitionConfig(method="natural", column="user"), RECORDS, "d.jsonl") == [
        ("data.labels", ["pos", "neg"], "class names covering every label of d.jsonl (not named: 'meh')")]


def test_a_wrong_label_column_is_reported_once_though_the_partition_defaults_to_it():
    data = DataConfig(format="classification", fields={"text": "sentence", "label": "sentimnt"})
    got = column_problems(data, PartitionConfig(method="dirichlet"), RECORDS, "d.jsonl")
    assert [key for key, _, _ in got] == ["data.fields.label"]


def test_a_recipe_that_fits_its_data_has_no_problem():
    data = DataConfig(format="classification", fields={"text": "sentence", "label": "sentiment"})
    assert column_problems(data, PartitionConfig(method="dirichlet"), RECORDS, "d.jsonl") == []  # label column
    assert column_problems(DataConfig(format="instruction"), PartitionConfig(method="iid"), [], "d.jsonl") == []


def test_the_sample_reads_the_head_of_a_local_file_only(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"i": i}) for i in range(50)) + "\n\nnot json\n")
    assert local_sample(str(path), n=10) == [{"i": i} for i in range(10)]  # the bad line is past the sample
    assert local_sample(str(path), n=100) is None  # the loader names that line later
    (tmp_path / "train.json").write_text(json.dumps({"data": [{"i": 1}]}))
    assert local_sample(str(tmp_path)) == [{"i": 1}]  # a directory: its <split> file, as the loader picks it
    assert local_sample("org/dataset") is None
