"""computed_in_fp32 (fedllm.export.upcast): a half-precision model computes what its fp32 cast computes, bit for bit,
one module's fp32 copy at a time, and holds exactly its own tensors afterwards — with the fp32 ``modules_to_save``
head of a bf16 classification model too (its dtype hooks would round the head's logits to bf16: issue #48 item 4's
first export change failed test_a_bf16_classification_run_evaluates_resumes_bit_exactly_and_exports on that)."""

import copy

import torch

from fedllm.export.upcast import computed_in_fp32
from fedllm.models.loading import load_model
from fedllm.recipe.schema import LoraConfig, ModelConfig


def _trained_like(model):
    """Non-zero LoRA B factors and a moved head, so the adapter and the fp32 copy both count in the logits."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.dtype))
    return model.eval()


def test_a_bf16_model_with_an_fp32_head_computes_as_its_fp32_cast():
    lm = load_model(ModelConfig(name="tiny-roberta", dtype="bf16"), LoraConfig(r=4, alpha=8))
    model = _trained_like(lm.model)
    head = model.base_model.model.classifier
    assert {p.dtype for p in head.original_module.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in head.modules_to_save["default"].parameters()} == {torch.float32}
    before = {k: (v.dtype, v.clone()) for k, v in model.state_dict().items()}
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    ids = lm.tokenizer(["good movie 3", "bad film, not good at all"], padding=True, return_tensors="pt")
    reference = copy.deepcopy(model).float()
    with torch.no_grad():
        want = reference(**ids).logits
        as_run = model(**ids).logits  # without the context: the hooks hand the bf16 model a bf16 logit
        with computed_in_fp32(model):
            got = model(**ids).logits
    assert as_run.dtype == torch.bfloat16 and want.dtype == got.dtype == torch.float32
    assert torch.equal(got, want)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(after[k].dtype == dtype and torch.equal(after[k], value) for k, (dtype, value) in before.items())
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()] == hooks
    with torch.no_grad():  # the hooks act again once the block is left
        assert model(**ids).logits.dtype == torch.bfloat16
