"""Run configs authorised by the SuperLink's operator (fedllm.flower.authorise), and what a refused run's log may
say (fedllm.flower.runtime.shown_in_run_log): ``pytest -k flower_security``."""

import base64
import hashlib

import pytest

pytest.importorskip("flwr")

from fedllm.commands.flower import config_text  # noqa: E402
from fedllm.common.errors import InputError  # noqa: E402
from fedllm.flower import authorise  # noqa: E402
from fedllm.flower.authorise import RunRefused, claim_nonce, sign, signed_recipe, verify  # noqa: E402
from fedllm.flower.runtime import shown_in_run_log  # noqa: E402
from fedllm.recipe.schema import RecipeError  # noqa: E402
from fedllm.runs.rundir import RunDirError  # noqa: E402


@pytest.fixture
def operator(tmp_path):
    keys = authorise.write_operator_key(tmp_path / "certs")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: {name: tiny-llama}\n")
    config = {"recipe": str(recipe), "overrides": "train.lr=0.01", "resume": False, "overwrite": False,
              "timeout": 600.0, "probe-mb": 0.0, "wait-nodes": 120.0}
    return keys, recipe, sign(config, recipe.read_bytes(), keys["operator_key"])


def test_flower_security_operator_key_is_private_from_creation(operator):
    keys, _, _ = operator
    assert oct(keys["operator_key"].stat().st_mode & 0o777) == "0o600"
    assert b"PRIVATE" not in keys["operator_pub"].read_bytes()


def test_flower_security_signed_config_verifies_and_binds_the_recipe_bytes(operator, tmp_path):
    keys, recipe, config = operator
    assert config["recipe-sha256"] == hashlib.sha256(recipe.read_bytes()).hexdigest()
    verify(config, keys["operator_pub"])
    assert signed_recipe(config) == recipe.read_bytes()
    recipe.write_text("model: {name: tiny-llama}\noutput_dir: /elsewhere\n")  # changed after signing
    with pytest.raises(RunRefused, match="is not the file that was signed"):
        signed_recipe(config)


@pytest.mark.parametrize("change", [
    {"overrides": "output_dir=/tmp/evil"}, {"recipe": "/etc/passwd"}, {"overwrite": True}, {"resume": True},
    {"timeout": 1.0}, {"recipe-sha256": "0" * 64}, {"nonce": "f" * 32}, {"issued": 1},
    {"signature": ""}, {"signature": "not base64!"},
])
def test_flower_security_altered_or_unsigned_config_is_refused(operator, change):
    keys, _, config = operator
    with pytest.raises(RunRefused, match="not signed with this SuperLink operator's key"):
        verify({**config, **change}, keys["operator_pub"])


def test_flower_security_other_operators_key_and_unsigned_configs_are_refused(operator, tmp_path):
    keys, recipe, config = operator
    other = authorise.write_operator_key(tmp_path / "other")
    with pytest.raises(RunRefused):
        verify(config, other["operator_pub"])
    with pytest.raises(RunRefused):
        verify({k: v for k, v in config.items() if k not in ("signature", "nonce", "issued")}, keys["operator_pub"])
    with pytest.raises(InputError, match="expected the operator's Ed25519 public key|not the operator's public key"):
        verify(config, keys["operator_key"])  # the private key file given where the public one belongs


def test_flower_security_expired_or_replayed_config_is_refused(operator, tmp_path):
    keys, _, config = operator
    verify(config, keys["operator_pub"], now=config["issued"] + authorise.MAX_AGE_S - 1)
    with pytest.raises(RunRefused, match="signed 601 s ago"):
        verify(config, keys["operator_pub"], now=config["issued"] + 601)
    used = tmp_path / "state" / "nonces"
    claim_nonce(config, used)
    with pytest.raises(RunRefused, match="submitted before"):
        claim_nonce(config, used)
    claim_nonce({**config, "nonce": "a" * 32}, used)  # another signed config goes through


def test_flower_security_signature_survives_flowers_run_config_parsing(operator):
    """The config as ``fedllm flower run`` writes it for ``--run-config``, parsed back by Flower, verifies."""
    from flwr.common.config import parse_config_args

    keys, _, config = operator
    parsed = parse_config_args([config_text(config)])
    assert parsed == config
    verify(parsed, keys["operator_pub"])
    assert base64.b64decode(parsed["signature"])


def test_flower_security_refused_input_shows_in_the_run_log_without_file_contents():
    leak = RecipeError("/srv/recipe.yaml", [("data.path", "/srv/private (holds: salaries.csv, keys.txt)",
                                             "a data file"), ("data.fields.text", "x", "one of: ssn, name")])
    told = shown_in_run_log(leak)
    assert told.startswith("/srv/recipe.yaml: 2 problem(s) in the recipe, at data.path, data.fields.text;")
    assert "salaries" not in told and "ssn" not in told
    other = InputError("data file /srv/d.jsonl line 3: fields password, token")
    assert "password" not in shown_in_run_log(other) and "InputError" in shown_in_run_log(other)
    for safe in (RunRefused("run refused: expired"), RunDirError("output_dir='/x' already holds a run")):
        assert shown_in_run_log(safe) == str(safe)
    wrapped = RuntimeError("ServerApp failed")
    wrapped.__cause__ = leak
    assert shown_in_run_log(wrapped) == told
