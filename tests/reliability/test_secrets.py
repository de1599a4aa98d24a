"""Credentials in URLs never reach a file fedllm writes (run dir, checkpoints, exports) or its messages."""

import io
import logging

import pytest
import yaml

from fedllm.commands.cli import main
from fedllm.common.redact import RedactingFilter, redact_text
from fedllm.engine.server import run
from fedllm.recipe.checks import parse_recipe

SECRET = "s3cretPa55"


@pytest.mark.parametrize("given,expected", [
    (f"https://me:{SECRET}@judge.example/v1", "https://***@judge.example/v1"),
    (f"http://{SECRET}@127.0.0.1:8000/v1", "http://***@127.0.0.1:8000/v1"),
    (f"https://h.example/v1?api_key={SECRET}&model=x", "https://h.example/v1?api_key=***&model=***"),
    # by rule: every query value and the fragment, whatever the parameter is called
    (f"https://gitlab.example/api/v4/projects?private_token={SECRET}", "https://gitlab.example/api/v4/projects?private_token=***"),
    (f"https://s3.example/b/o?access_key={SECRET}&expires=9", "https://s3.example/b/o?access_key=***&expires=***"),
    (f"https://storage.googleapis.com/b/o?X-Goog-Signature={SECRET}", "https://storage.googleapis.com/b/o?X-Goog-Signature=***"),
    (f"https://idp.example/cb?code={SECRET}&state=1", "https://idp.example/cb?code=***&state=***"),
    (f"https://app.example/cb#access_token={SECRET}&t=bearer", "https://app.example/cb#***"),
    (f"https://h.example:8443/v1/?{SECRET}", "https://h.example:8443/v1/?***"),
    # secret-named keys outside URLs (headers, key=value, JSON); tokenizer names are not secrets
    (f"Authorization: Bearer {SECRET}", "Authorization: ***"),
    (f"X-Api-Key: {SECRET}", "X-Api-Key: ***"),
    (f'{{"password": "{SECRET}", "pad_token": "<eos>"}}', '{"password": "***", "pad_token": "<eos>"}'),
    (f"private_token={SECRET} secret_key={SECRET} sort_key=a", "private_token=*** secret_key=*** sort_key=a"),
    ("api_key_env: OPENAI_API_KEY; max_new_tokens: 5; dotted.key=value", "api_key_env: OPENAI_API_KEY; max_new_tokens: 5; dotted.key=value"),
    (f"s3://bucket/data.jsonl?X-Amz-Signature={SECRET}", "s3://bucket/data.jsonl?X-Amz-Signature=***"),
    (f"see https://a:{SECRET}@x.example and https://b:{SECRET}@y.example", "see https://***@x.example and https://***@y.example"),
    ("https://judge.example/v1", "https://judge.example/v1"),
    ("write to me@example.com or runs/run@2", "write to me@example.com or runs/run@2"),
])
def test_redact_text(given, expected):
    assert redact_text(given) == expected


def _files(root):
    return [p for p in root.rglob("*") if p.is_file()]


def test_no_file_of_a_run_or_its_export_holds_the_password(tiny_recipe, tmp_path):
    url = f"https://me:{SECRET}@judge.example/v1?private_token={SECRET}&code={SECRET}#access_token={SECRET}"
    raw = tiny_recipe(federation={"rounds": 2}, checkpoint={"every": 1}, eval={"judge": {"base_url": url}},
                      logging={"report_to": ["tensorboard", "mlflow"]})
    recipe = parse_recipe(raw)
    assert recipe.eval.judge.base_url == url  # the run itself uses the URL as given
    result = run(recipe)
    written = _files(result.run_dir)
    assert any(p.name == "recipe.yaml" and p.parent.name == "final" for p in written)
    assert any("tensorboard" in p.parts for p in written) and any("mlruns" in p.parts for p in written)
    for path in written:
        assert SECRET.encode() not in path.read_bytes(), path
    assert yaml.safe_load((result.run_dir / "recipe.yaml").read_text())["eval"]["judge"]["base_url"] == \
        "https://***@judge.example/v1?private_token=***&code=***#***"
    out = tmp_path / "export"
    assert main(["export", str(result.run_dir), "--format", "adapter", "--out", str(out)]) == 0
    assert (out / "README.md").is_file()
    for path in _files(out):
        assert SECRET.encode() not in path.read_bytes(), path


def test_cli_messages_are_redacted(tiny_recipe, tmp_path, capsys):
    raw = tiny_recipe(eval={"judge": {"base_ur": f"https://me:{SECRET}@judge.example/v1"}})
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "eval.judge.base_ur: got 'https://***@judge.example/v1'" in err and SECRET not in err


def test_log_lines_are_redacted():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("fedllm.test_secrets")
    logger.addHandler(handler)
    try:
        logger.warning("judge at %s did not answer", f"https://me:{SECRET}@judge.example/v1")
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue() == "judge at https://***@judge.example/v1 did not answer\n"


def test_the_interrupt_hint_masks_credentials_given_on_the_command_line(tiny_recipe, tmp_path, monkeypatch, capsys):
    import fedllm.engine.server

    def interrupted(recipe, *args, **kwargs):  # stopped after writing something: the hint is the resume command
        from pathlib import Path

        Path(recipe.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(recipe.output_dir) / "metrics.jsonl").write_text("")
        raise KeyboardInterrupt

    monkeypatch.setattr(fedllm.engine.server, "run", interrupted)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe()))
    assert main(["train", str(recipe), f"eval.judge.base_url=https://me:{SECRET}@judge.example/v1?token={SECRET}"]) == 130
    err = capsys.readouterr().err
    assert SECRET not in err
    assert "resume with: fedllm train" in err and "https://***@judge.example/v1?token=***" in err
    assert "credentials masked: give them again" in err
