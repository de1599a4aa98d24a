"""Each train.preference.loss equals trl's on the same batch: loss, implicit rewards and every LoRA gradient.

The expectation is trl 1.16 itself: ``DPOTrainer.compute_loss`` (sigmoid, ipo, hinge, robust) on a copy of the
same tiny LLaMA, and ``CPOTrainer.get_batch_logps`` + ``CPOTrainer.cpo_loss`` (simpo, ``cpo_alpha=0``: no NLL
term) called on the model's logits. trl, given a PEFT model, keeps a copy of its adapter as training starts (the
``ref`` adapter) as the reference; here that adapter is fresh (B = 0), and both copies' trained adapter is then
moved to the same random point, so policy and reference differ. fedllm's side is
:func:`fedllm.models.preference_loss.pair_loss` on fedllm's own encoding and collation of the same records, with
the reference either precomputed before the move (``reference: precomputed``) or the adapter disabled
(``reference: adapter_disabled``): both equal trl's.
"""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch

from fedllm.data.collate import collate
from fedllm.data.formats import make_encoder
from fedllm.models.loading import load_model, load_tokenizer
from fedllm.models.preference_loss import pair_loss, sequence_logps
from fedllm.recipe.schema import DataConfig, LoraConfig, ModelConfig, PreferenceConfig

pytest.importorskip("trl")

# short answers: trl's log-probabilities are float32 sums (its chunked LM-head kernel accumulates in float32), so
# their error grows with the answer's length; with a few tokens per answer it stays well below 1e-6
RECORDS = [
    {"prompt": "What is 2 + 3?", "chosen": " 5", "rejected": " 6"},
    {"prompt": "Name a colour.", "chosen": " Blue", "rejected": " No"},
    {"prompt": "Say hello.", "chosen": " Hi", "rejected": " 7"},
]


@pytest.fixture(scope="module")
def setup():
    """A tiny LLaMA with a fresh LoRA adapter (B = 0) and its tokenizer."""
    cfg = ModelConfig(name="tiny-llama")
    tokenizer = load_tokenizer(cfg)
    model = load_model(cfg, LoraConfig(r=4, alpha=8), seed=0, tokenizer=tokenizer).model
    model.double()  # float64 on both sides: the comparison is of formulas, not of float32 summation orders
    model.train()
    return model, tokenizer


def _move(model) -> None:
    """Set the trained adapter's B factors to a fixed random point (the same in every copy)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B.default" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 3.0)


def _batch(tokenizer) -> dict:
    encode = make_encoder(tokenizer, DataConfig(format="preference", template="plain"), 128)
    return collate([encode(r) for r in RECORDS], tokenizer.pad_token_id)


def _close(ours: torch.Tensor, theirs: torch.Tensor, name: str, tol: float = 1e-6) -> None:
    """Equal to ``tol`` of the tensor's scale (its largest entry, at least 1)."""
    scale = max(1.0, float(theirs.abs().max()))
    torch.testing.assert_close(ours, theirs.to(ours.dtype), atol=tol * scale, rtol=0, msg=lambda m: f"{name}: {m}")


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if ".default." in n and p.requires_grad}


def _fedllm(model, tokenizer, pref: PreferenceConfig, precomputed: bool):
    """fedllm's loss after :func:`_move`, the reference precomputed before it or taken adapter-disabled."""
    batch = _batch(tokenizer)
    if precomputed:
        with torch.no_grad():
            batch["ref_logps"] = sequence_logps(model, batch).logps
    _move(model)
    model.zero_grad(set_to_none=True)
    out = pair_loss(model, batch, pref, "supervised")
    out.loss.backward()
    return out, _grads(model)


def _trl_dpo(model, tokenizer, loss: str, beta: float, label_smoothing: float):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir="unused",
        report_to=[],
        max_length=128,
        use_cpu=True,
        loss_type=[loss],
        beta=beta,
        label_smoothing=label_smoothing,
        per_device_train_batch_size=len(RECORDS),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(
            model=model, args=args, train_dataset=Dataset.from_list(RECORDS), processing_class=tokenizer
        )
    assert "ref" in model.peft_config  # trl's reference: the adapter as training started
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(RECORDS))])
    _move(model)
    model.zero_grad(set_to_none=True)
    loss_value = trainer.compute_loss(trainer.model, batch)
    loss_value.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss_value, metrics, _grads(model)


@pytest.mark.parametrize("precomputed", [True, False], ids=["precomputed", "adapter_disabled"])
@pytest.mark.parametrize(
    "loss, beta, eps", [("sigmoid", 0.5, 0.0), ("ipo", 0.5, 0.0), ("hinge", 0.3, 0.0), ("robust", 0.2, 0.2)]
)
def test_preference_dpo_losses_equal_trl_dpo_trainer(setup, loss, beta, eps, precomputed):
    model, tokenizer = setup
    theirs, mine = copy.deepcopy(model), copy.deepcopy(model)
    ours, our_grads = _fedllm(mine, tokenizer, PreferenceConfig(loss=loss, beta=beta, label_smoothing=eps), precomputed)
    loss_value, metrics, their_grads = _trl_dpo(theirs, tokenizer, loss, beta, eps)
    assert float(ours.chosen_rewards.abs().min()) > 1e-2  # the policy is not the reference
    torch.testing.assert_close(ours.loss, loss_value.detach().to(ours.loss.dtype), atol=1e-6, rtol=0)
    assert float(ours.chosen_rewards.mean()) == pytest.approx(metrics["rewards/chosen"], abs=1e-6)
    assert float(ours.rejected_rewards.mean()) == pytest.approx(metrics["rewards/rejected"], abs=1e-6)
    margins = ours.chosen_rewards - ours.rejected_rewards
    assert float(margins.mean()) == pytest.approx(metrics["rewards/margins"], abs=1e-6)
    assert float((margins > 0).float().mean()) == metrics["rewards/accuracies"]
    assert our_grads.keys() == their_grads.keys() and len(our_grads) > 0
    for name in our_grads:
        assert their_grads[name].abs().max() > 0
        # trl's chunked LM-head kernel accumulates its softmax and its backward in float32 whatever the model's
        # dtype (trl/kernels/chunked_logprob.py), so its gradients carry float32 rounding: 1e-5 of their scale
        _close(our_grads[name], their_grads[name], name, tol=1e-5)


def test_preference_simpo_equals_trl_cpo_loss(setup):
    from trl.experimental.cpo import CPOTrainer

    model, tokenizer = setup
    pref = PreferenceConfig(loss="simpo", beta=2.0, gamma=0.5, label_smoothing=0.1)
    ours, our_grads = _fedllm(copy.deepcopy(model), tokenizer, pref, precomputed=False)
    # trl: logits of the same concatenated batch, CPOTrainer.get_batch_logps(average_log_prob=True), cpo_loss
    batch = _batch(tokenizer)
    theirs = copy.deepcopy(model)
    _move(theirs)
    theirs.zero_grad(set_to_none=True)
    logits = theirs(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps = CPOTrainer.get_batch_logps(logits, batch["labels"], average_log_prob=True)
    n = len(RECORDS)
    fake = types.SimpleNamespace(
        alpha=0.0,
        beta=pref.beta,
        label_smoothing=pref.label_smoothing,
        loss_type="simpo",
        simpo_gamma=pref.gamma,
        accelerator=types.SimpleNamespace(device="cpu"),
    )
    losses, chosen, rejected = CPOTrainer.cpo_loss(fake, logps[:n], logps[n:])
    losses.mean().backward()
    torch.testing.assert_close(ours.loss, losses.mean().detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.chosen_rewards, chosen, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.rejected_rewards, rejected, atol=1e-6, rtol=0)
    for name, grad in our_grads.items():
        other = dict(theirs.named_parameters())[name].grad
        assert other.abs().max() > 0
        _close(grad, other, name)


def test_preference_supervised_positions_equal_all_positions(setup):
    """The LM head run only at answer positions gives the full-vocabulary sums (fedllm's two paths agree)."""
    model, tokenizer = setup
    model = copy.deepcopy(model)
    _move(model)
    batch = _batch(tokenizer)
    with torch.no_grad():
        a, b = sequence_logps(model, batch, "supervised"), sequence_logps(model, batch, "all")
    torch.testing.assert_close(a.logps, b.logps, atol=1e-5, rtol=1e-6)
    assert torch.equal(a.lengths, b.lengths) and bool((a.lengths > 0).all())
