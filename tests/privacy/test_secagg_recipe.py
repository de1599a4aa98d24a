"""``privacy.secure_aggregation: secagg_plus`` at recipe load: its parameters, the mechanisms and screens that need
individual updates refused with the reason, exit 2 from the command line (``pytest -k secagg``)."""

import pytest
import yaml

from fedllm.common.errors import InputError
from fedllm.privacy.secagg.settings import round_params
from fedllm.recipe.checks import parse_recipe

SECAGG = {"secure_aggregation": "secagg_plus"}


def raw(federation=None, privacy=None):
    return {
        "data": {"path": "unused.jsonl"},
        "train": {"local_steps": 1},
        "federation": {"num_clients": 6, "clients_per_round": 5, **(federation or {})},
        "privacy": {**SECAGG, **(privacy or {})},
    }


def test_secagg_defaults_and_round_parameters():
    r = parse_recipe(raw())
    assert r.privacy.secure_aggregation == "secagg_plus" and r.privacy.secagg.neighbours == 8
    p = round_params(r.privacy.secagg, 5, total_weight=100)
    assert (p.effective_neighbours(5), p.threshold, p.mod_bits, p.quantization_bits) == (4, 3, 32, 20)
    assert round_params(r.privacy.secagg, 5, total_weight=5000).mod_bits == 64  # (2^20 - 1)·5000 >= 2^32
    assert parse_recipe(raw(privacy={"secure_aggregation": False})).privacy.secure_aggregation is False  # old files
    assert parse_recipe(raw(privacy={"secure_aggregation": "none"})).privacy.secure_aggregation == "none"


@pytest.mark.parametrize(
    "federation,privacy,key,expected",
    [
        (
            {"clients_per_round": 3},
            {},
            "privacy.secagg.threshold",
            r"more than half the 2 neighbours .* at most neighbours - max_dropouts = 1 .*got 1 \(with 3 clients per round",
        ),
        ({}, {"secagg": {"threshold": 2}}, "privacy.secagg.threshold", "more than half the 4 neighbours"),
        ({}, {"secagg": {"quantization_bits": 64}}, "privacy.secagg.quantization_bits", r"in \[1, 63\]$"),
        ({}, {"secagg": {"quantization_range": 0.0}}, "privacy.secagg.quantization_range", "a positive number"),
        ({"clients_per_round": 1}, {}, "federation.clients_per_round", "at least 2 per round"),
        (
            {},
            {"mechanism": "central", "noise_multiplier": 1.0},
            "privacy.mechanism",
            "server-side clipping needs each client's update",
        ),
        ({"max_update_norm": 2.0}, {}, "federation.max_update_norm", "the server sees no client's update"),
        (
            {"strategy": "fedmedian"},
            {},
            "privacy.secure_aggregation",
            "coordinate-wise median of the individual uploads",
        ),
    ],
)
def test_secagg_bad_settings_name_the_key_and_the_reason(federation, privacy, key, expected):
    with pytest.raises(InputError, match=expected) as err:
        parse_recipe(raw(federation, privacy))
    assert f"- {key}:" in str(err.value)


def test_secagg_client_clipping_dp_and_dp_sgd_are_accepted():
    dp = {"noise_multiplier": 1.0, "clipping_norm": 0.5}
    assert parse_recipe(raw(privacy={"mechanism": "central_client_clipping", **dp})).privacy.mechanism
    assert parse_recipe(raw(privacy={"mechanism": "dp_sgd", **dp})).privacy.mechanism == "dp_sgd"


def test_secagg_a_refused_strategy_exits_2_from_the_command_line(tmp_path, capsys, arith_file):
    from fedllm.commands.cli import main
    from tests.conftest import tiny_raw

    recipe = tiny_raw(
        tmp_path / "run",
        arith_file,
        federation={"strategy": "krum", "num_clients": 4, "clients_per_round": 4},
        privacy=SECAGG,
    )
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["train", str(path)]) == 2
    assert "selects individual uploads by their Krum scores" in capsys.readouterr().err
