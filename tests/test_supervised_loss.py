"""Loss-only logits equal the plain full-vocabulary loss, value and every LoRA gradient."""

import pytest
import torch
import transformers

from fedllm.models.loading import attach_lora, load_model
from fedllm.models.supervised_loss import all_positions_loss, loss_path, supervised_positions_loss
from fedllm.recipe.schema import LoraConfig, ModelConfig


def _batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Three right-padded rows; a prompt (label -100) then a response, lengths 11, 7, 4."""
    gen = torch.Generator().manual_seed(seed)
    lengths, prompts, width = [11, 7, 4], [5, 3, 1], 11
    ids = torch.randint(3, vocab, (3, width), generator=gen)
    mask = torch.zeros(3, width, dtype=torch.long)
    labels = torch.full((3, width), -100)
    for i, (n, p) in enumerate(zip(lengths, prompts, strict=True)):
        mask[i, :n] = 1
        labels[i, p:n] = ids[i, p:n]
        ids[i, n:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _gemma2_softcapped():
    """A tiny Gemma 2 whose final logit soft-capping matters: head weights x30 (logits ~10), cap 1."""
    tok_vocab = 300
    cfg = transformers.Gemma2Config(vocab_size=tok_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    final_logit_softcapping=1.0, attn_logit_softcapping=None,
                                    pad_token_id=0, max_position_embeddings=64)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        base.get_output_embeddings().weight.mul_(30)
    return attach_lora(base, LoraConfig(r=4, alpha=8, init="gaussian"), "causal_lm"), tok_vocab


def _tiny(family: str):
    if family == "gemma2-softcap":
        return _gemma2_softcapped()
    loaded = load_model(ModelConfig(name=f"tiny-{family}"), LoraConfig(r=4, alpha=8, init="gaussian"))
    return loaded.model, loaded.model.get_base_model().config.vocab_size


def _randomize_lora(model) -> None:
    """Non-zero A and B (PEFT starts B at zero, which would leave A's gradient zero)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _loss_and_grads(model, fn, batch):
    model.zero_grad(set_to_none=True)
    loss = fn(model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "gemma2-softcap"])
def test_supervised_positions_equal_full_loss_and_lora_gradients(family):
    model, vocab = _tiny(family)
    model.train()
    _randomize_lora(model)
    batch = _batch(vocab)
    full, g_full = _loss_and_grads(model, all_positions_loss, batch)
    fast, g_fast = _loss_and_grads(model, supervised_positions_loss, batch)
    assert torch.isclose(fast, full, rtol=1e-5, atol=0), (fast, full)
    assert g_full.keys() == g_fast.keys() and len(g_full) > 0
    assert all("lora_" in k for k in g_full)
    for k in g_full:
        assert g_full[k].abs().sum() > 0, k
        err = (g_fast[k] - g_full[k]).norm() / g_full[k].norm()
        assert err < 1e-5, (k, float(err))


def test_softcapping_is_applied():
    """The capped model's loss differs from the same weights without the cap (so the test above checks it)."""
    model, vocab = _gemma2_softcapped()
    batch = _batch(vocab)
    with torch.no_grad():
        capped = supervised_positions_loss(model, batch)
        model.get_base_model().config.final_logit_softcapping = None
        uncapped = supervised_positions_loss(model, batch)
        plain_uncapped = all_positions_loss(model, batch)
    assert abs(float(capped) - float(uncapped)) > 0.1, (capped, uncapped)
    assert torch.isclose(uncapped, plain_uncapped, rtol=1e-5)


def test_hand_computed_loss_on_one_position():
    """One supervised position: the loss is -log softmax(head(h))[target] at that position."""
    model, vocab = _tiny("llama")
    batch = _batch(vocab)
    batch["labels"] = torch.full_like(batch["labels"], -100)
    batch["labels"][1, 4] = batch["input_ids"][1, 4]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        expected = -torch.log_softmax(logits[1, 3].double(), -1)[batch["input_ids"][1, 4]]
        got = supervised_positions_loss(model, batch)
    assert abs(float(got) - float(expected)) < 1e-5


def test_loss_path_choice():
    model, _ = _tiny("llama")
    assert loss_path(model, "supervised") is supervised_positions_loss
    assert loss_path(model, "all") is all_positions_loss
    assert loss_path(model, "supervised", task="classification") is all_positions_loss
    roberta = load_model(ModelConfig(name="tiny-roberta"), LoraConfig(r=4, alpha=8)).model
    assert loss_path(roberta, "supervised") is all_positions_loss
