"""train.packing: a micro-batch as one row of its sequences (fedllm.data.packing) trains as the padded batch does.

The per-sequence losses and LoRA gradients of a packed batch equal the padded batch's in fp32 on a tiny LLaMA and
a tiny Qwen2 (and would not without the position ids: the control case); the recipe refuses what cannot hold
(exit 2); a packed run trains, matches the padded run, reports no padding and resumes bit-exactly; the dry run
says it packs.
"""

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fedllm.data.collate import collate
from fedllm.data.packing import fill_rows, pack_batch, pack_examples, sequence_index
from fedllm.data.tokens import IGNORE_INDEX
from fedllm.models.grouped_attention import BLOCKED_NAME
from fedllm.models.loading import load_model
from fedllm.models.supervised_loss import all_positions_loss, supervised_hidden, supervised_positions_loss, token_losses
from fedllm.recipe.schema import LoraConfig, ModelConfig

LENGTHS, PROMPTS = [11, 7, 30, 4], [5, 3, 12, 1]  # tokens per example, of which prompt (no loss)


def _examples(vocab: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for n, p in zip(LENGTHS, PROMPTS, strict=True):
        ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * p + ids[p:]})
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request):
    """A tiny model with non-zero LoRA factors (B = 0 would leave A's gradient zero), and its vocabulary size."""
    model = load_model(ModelConfig(name=f"tiny-{request.param}"), LoraConfig(r=4, alpha=8, init="gaussian")).model
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model, model.get_base_model().config.vocab_size


def _examples_of(position_ids: torch.Tensor, rows: list[list[int]] | None) -> torch.Tensor:
    """The example of each position of packed rows (rows: the examples of each row, None: one row of all)."""
    within = sequence_index(position_ids)
    if rows is None:
        return within
    table = torch.full((len(rows), int(within.max()) + 1), -1)
    for r, examples in enumerate(rows):
        table[r, :len(examples)] = torch.tensor(examples)
    return table.gather(1, within)  # -1: a row's padding sequence


def _per_sequence(model, batch: dict, sequences: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Mean next-token loss of each example (in order), from the gathered supervised positions; ``sequences``: the
    example of each position of packed rows (default: one row, from its position ids)."""
    hidden, targets, rows = supervised_hidden(model, batch)
    if "position_ids" in batch:  # the sequence of each predicting position (its target is in the same one)
        keep = batch["labels"][:, 1:] != IGNORE_INDEX
        rows = (sequence_index(batch["position_ids"]) if sequences is None else sequences)[:, :-1][keep]
    losses = token_losses(model, hidden, targets)
    return [losses[rows == k].mean() for k in range(len(LENGTHS))]


def _lora_grads(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_a_packed_row_is_the_examples_end_to_end():
    """Hand-written: position ids restart at each sequence; each sequence's first label is -100 (the previous
    sequence's last token predicts nothing); the padded batch packs to the same row."""
    examples = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    packed = pack_examples(examples)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert packed["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert sequence_index(packed["position_ids"]).tolist() == [[0, 0, 0, 1, 1]]
    from_padded = pack_batch(collate(examples, pad_id=0))
    assert from_padded.keys() == packed.keys() and all(torch.equal(from_padded[k], packed[k]) for k in packed)


def test_packed_rows_are_balanced_and_end_in_a_padding_sequence():
    """Rows of at most 4 positions: [3] and [2, 2] (longest first onto the shortest row); the shorter row ends in
    one padding position that is a sequence of its own (position 0, label -100)."""
    assert fill_rows([3, 2, 2], 4) == [[0], [1, 2]]
    # a row holds at least the longest example: capacity 5, 11 positions -> 3 rows: 5 | 3 | 2 + 1
    assert fill_rows([2, 5, 1, 3], 4) == [[1], [3], [0, 2]]
    # 420 positions in rows of 400: two rows of 210, not 330 + 90 (first fit)
    assert fill_rows([120, 110, 100, 90], 400) == [[0, 3], [1, 2]]
    examples = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]},
                {"input_ids": [10, 11], "labels": [10, 11]}]
    packed = pack_batch(collate(examples, pad_id=0), row_length=4)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 10, 11]]
    assert packed["labels"].tolist() == [[-100, 6, 7, -100], [-100, 9, -100, 11]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 0, 1]]


@pytest.mark.parametrize("row_length", [None, 32], ids=["one-row", "rows-of-32"])
def test_packed_per_sequence_losses_and_lora_gradients_equal_the_padded_ones(tiny, row_length):
    model, vocab = tiny
    padded = collate(_examples(vocab), pad_id=0)
    packed = pack_batch(padded, row_length)
    rows = None if row_length is None else fill_rows(LENGTHS, row_length)
    assert packed["input_ids"].shape == ((1, sum(LENGTHS)) if rows is None else (2, 30))  # rows [30], [11, 7, 4]
    sequences = _examples_of(packed["position_ids"], rows)
    per_padded = _per_sequence(model, padded)
    for k in range(len(LENGTHS)):
        assert _per_sequence(model, packed, sequences)[k].item() == pytest.approx(per_padded[k].item(), abs=1e-5)
        a = _lora_grads(model, _per_sequence(model, padded)[k])
        b = _lora_grads(model, _per_sequence(model, packed, sequences)[k])
        assert a.keys() == b.keys() and all(torch.allclose(a[n], b[n], atol=1e-5, rtol=0) for n in a), k
    for loss in (supervised_positions_loss, all_positions_loss):  # the micro-batch loss of both loss paths
        a, b = _lora_grads(model, loss(model, padded)), _lora_grads(model, loss(model, packed))
        assert loss(model, packed).item() == pytest.approx(loss(model, padded).item(), abs=1e-5)
        assert all(torch.allclose(a[n], b[n], atol=1e-5, rtol=0) for n in a)
    # the control: the same rows without their position ids are long sequences, and every later example of a row
    # sees the ones before it
    width = packed["input_ids"].shape[1]
    leaky = _per_sequence(model, {**packed, "position_ids": torch.arange(width).expand(len(rows or [0]), -1)},
                          sequences)
    firsts = {0} if rows is None else {r[0] for r in rows}
    for k in range(len(LENGTHS)):
        gap = abs(leaky[k].item() - per_padded[k].item())
        assert gap < 1e-5 if k in firsts else gap > 1e-3, (k, gap)


def test_packed_losses_under_eager_attention_equal_the_padded_ones(tiny):
    """The attention a bf16 CPU step takes for short rows (eager) builds the same block-diagonal mask."""
    model, vocab = tiny
    config = model.get_base_model().config
    padded = collate(_examples(vocab), pad_id=0)
    config._attn_implementation = "eager"
    try:
        got = supervised_positions_loss(model, pack_batch(padded))
    finally:
        config._attn_implementation = "sdpa"
    assert got.item() == pytest.approx(supervised_positions_loss(model, padded).item(), abs=1e-5)


@pytest.mark.parametrize("device,dtype,positions,flash,expected", [
    ("cpu", "bf16", 512, False, "eager"), ("cpu", "bf16", 513, False, None), ("cpu", "fp32", 50, False, None),
    ("cuda", "bf16", 4000, True, "flash_attention_2"), ("cuda", "bf16", 4000, False, None),
    ("cuda", "fp32", 4000, True, None)])
def test_a_packed_row_takes_flash_varlen_on_a_gpu_where_installed_and_eager_for_short_cpu_rows(
        monkeypatch, device, dtype, positions, flash, expected):
    import transformers.utils

    from fedllm.engine.client import training_attention_choice

    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: flash)
    assert training_attention_choice("sdpa", torch.device(device), dtype, positions, packed=True) == expected
    assert training_attention_choice("eager", torch.device(device), dtype, positions, packed=True) is None
    unpacked = training_attention_choice("sdpa", torch.device(device), dtype, positions)  # batches of padded rows
    long_cpu = device == "cpu" and dtype == "bf16"
    assert unpacked == ("eager" if long_cpu and positions <= 256 else BLOCKED_NAME if long_cpu else None)


def test_packed_rows_are_train_max_length_for_a_dense_kernel_and_one_for_flash_varlen(tiny, monkeypatch):
    from fedllm.engine import client
    from fedllm.recipe.schema import TrainConfig

    model, _ = tiny
    cfg = TrainConfig(local_steps=1, max_length=77, dtype="bf16", packing=True)
    assert client.packed_row_length(model, cfg) == 77  # a CPU: eager or SDPA, each computing its rows' squares
    monkeypatch.setattr(client, "training_attention_choice", lambda *a, **k: "flash_attention_2")
    assert client.packed_row_length(model, cfg) is None  # one row: flash's varlen kernel needs one


REFUSED = [
    ({"model": {"name": "tiny-roberta"}}, "for a sequence classifier"),
    ({"train": {"clients_per_pass": 2}}, "with train.clients_per_pass: 2"),
    ({"privacy": {"mechanism": "dp_sgd", "noise_multiplier": 1.0, "clipping_norm": 1.0}},
     "with privacy.mechanism: dp_sgd"),
    ({"train": {"objective": "dpo"}}, "with train.objective: dpo"),
]


@pytest.mark.parametrize("section,why", REFUSED, ids=["classifier", "clients_per_pass", "dp_sgd", "dpo"])
def test_a_packing_recipe_that_cannot_hold_is_refused_with_its_reason(tiny_recipe, section, why):
    from fedllm.recipe.checks import parse_recipe
    from fedllm.recipe.schema import RecipeError

    raw = tiny_recipe(**section)
    raw["train"]["packing"] = True
    with pytest.raises(RecipeError) as e:
        parse_recipe(raw, source="r.yaml")
    assert ("train.packing", True) in [(k, g) for k, g, _ in e.value.problems]
    assert any(k == "train.packing" and why in expected for k, _, expected in e.value.problems), e.value.problems
    del raw["train"]["packing"]
    assert not any(k == "train.packing" for k, _, _ in _problems(raw))


def _problems(raw):
    from fedllm.recipe.checks import parse_recipe
    from fedllm.recipe.schema import RecipeError

    try:
        parse_recipe(raw)
    except RecipeError as e:
        return e.problems
    return []


def test_a_packing_recipe_error_exits_2_naming_file_key_and_reason(tiny_recipe, tmp_path, capsys):
    from fedllm.commands.cli import main

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(model={"name": "tiny-roberta"}, train={"packing": True})))
    assert main(["train", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "train.packing: got True; expected false for a sequence classifier" in err


def _recipe(tiny_recipe, ragged_file, out, **train):
    from fedllm.recipe.checks import parse_recipe

    return parse_recipe(tiny_recipe(output_dir=str(out), data={"path": str(ragged_file)},
                                    federation={"rounds": 3, "num_clients": 2, "clients_per_round": 2},
                                    train={"local_steps": 2, "batch_size": 4, "max_length": 96, **train},
                                    checkpoint={"every": 1}))


def test_a_packed_run_matches_the_padded_run_pads_little_and_resumes_bit_exactly(tiny_recipe, ragged_file,
                                                                                    tmp_path, crash_at_round):
    from fedllm.engine.server import run

    padded = run(_recipe(tiny_recipe, ragged_file, tmp_path / "padded", max_length=400))
    full = run(_recipe(tiny_recipe, ragged_file, tmp_path / "full", packing=True, max_length=400))
    recipe = _recipe(tiny_recipe, ragged_file, tmp_path / "cut", packing=True, max_length=400)
    crash_at_round(2)
    with pytest.raises(RuntimeError, match="power cut"):
        run(recipe)
    crash_at_round(None)
    resumed = run(recipe, resume=True)

    def adapter(result):
        return load_file(str(result.run_dir / "final" / "adapter.safetensors"))

    a, b, p = adapter(full), adapter(resumed), adapter(padded)
    assert a.keys() == b.keys() == p.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], p[k]) for k in a)  # other kernels: not the same bits ...
    assert all(torch.allclose(a[k], p[k], atol=1e-4, rtol=0) for k in a)  # ... but the same training
    lines = [json.loads(x) for x in (full.run_dir / "metrics.jsonl").read_text().splitlines()]
    padded_lines = [json.loads(x) for x in (padded.run_dir / "metrics.jsonl").read_text().splitlines()]
    # padded 23-29 % of positions; packed only the ends of the shorter rows: 0.7-3.7 %
    assert all(x["padded_fraction"] < 0.2 * y["padded_fraction"] for x, y in zip(lines, padded_lines, strict=True))
    for x, y in zip(lines, padded_lines, strict=True):
        assert x["client_loss"] == pytest.approx(y["client_loss"], abs=1e-4)


def test_the_dry_run_says_it_packs(tiny_recipe, ragged_file, tmp_path):
    from fedllm.commands.dry_run import dry_run

    report = dry_run(_recipe(tiny_recipe, ragged_file, tmp_path / "dry", packing=True)).report()
    assert "packed: each micro-batch's examples end to end in one row, no padding (train.packing)" in report
    assert "packed" not in dry_run(_recipe(tiny_recipe, ragged_file, tmp_path / "dry")).report()


def test_a_bf16_cpu_client_picks_each_packed_rows_attention_by_its_length(tiny_recipe, ragged_file, tmp_path,
                                                                          monkeypatch):
    from fedllm.engine import client
    from fedllm.engine.server import build_federation
    from fedllm.models.loading import read_state

    fed = build_federation(_recipe(tiny_recipe, ragged_file, tmp_path / "bf16", packing=True, dtype="bf16",
                                   max_length=400))  # one row per micro-batch
    config = fed.loaded.model.get_base_model().config
    monkeypatch.setattr(client, "EAGER_PACKED_ROW_MAX_LENGTH", 290)  # this client's micro-batches: 1 x 285, 2 x 299
    seen = []
    original = client.micro_batch_loss
    monkeypatch.setattr(client, "micro_batch_loss", lambda model, batch, cfg: seen.append(
        (batch["input_ids"].shape, config._attn_implementation)) or original(model, batch, cfg))
    plan = fed.strategy.configure_client(1, 0, read_state(fed.loaded.model, fed.global_keys))
    plan.lr = 1e-2
    client.train_client(fed.loaded.model, plan, fed.strategy, fed.data.examples, fed.data.clients[0], fed.recipe.train,
                        lambda items: collate(items, fed.loaded.tokenizer.pad_token_id), seed=0)
    assert len(seen) == 2 and all(shape[1] <= 400 for shape, _ in seen)  # rows of at most train.max_length
    assert [impl for _, impl in seen] == ["eager" if shape[1] <= 290 else "sdpa" for shape, _ in seen]
    assert {impl for _, impl in seen} == {"eager", "sdpa"} or pytest.fail(f"rows {seen}: widen the fixture's spread")
    assert config._attn_implementation == "sdpa"  # restored


def test_packing_on_a_gpu_without_flash_warns_once_that_dense_rows_were_slower(monkeypatch, caplog):
    """docs/gpu.md measured dense packed rows at 0.48-0.83x the padded batches on an H100: a user is told once."""
    from types import SimpleNamespace

    from fedllm.engine import client
    from fedllm.recipe.schema import TrainConfig

    class OnGpu(torch.nn.Module):  # parameters() is all packed_row_length reads of the device
        config = SimpleNamespace(_attn_implementation="sdpa")

        def parameters(self, recurse=True):
            yield SimpleNamespace(device=torch.device("cuda"))

    monkeypatch.setattr(client, "training_attention_choice", lambda *a, **k: None)  # no flash-attn
    client._warn_dense_packing_on_gpu.cache_clear()
    cfg = TrainConfig(local_steps=1, max_length=64, dtype="bf16", packing=True)
    with caplog.at_level("WARNING", logger="fedllm"):
        assert client.packed_row_length(OnGpu(), cfg) == 64
        assert client.packed_row_length(OnGpu(), cfg) == 64
    warned = [r.getMessage() for r in caplog.records if "train.packing on a GPU" in r.getMessage()]
    assert len(warned) == 1 and "train.packing: false" in warned[0]
    monkeypatch.setattr(client, "training_attention_choice", lambda *a, **k: "flash_attention_2")
    client._warn_dense_packing_on_gpu.cache_clear()
    with caplog.at_level("WARNING", logger="fedllm"):
        caplog.clear()
        assert client.packed_row_length(OnGpu(), cfg) is None  # flash's varlen kernel: no warning
    assert not [r for r in caplog.records if "train.packing on a GPU" in r.getMessage()]
