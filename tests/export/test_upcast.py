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


def _tiny_llama_bf16():
    lm = load_model(ModelConfig(name="tiny-llama", dtype="bf16"), LoraConfig(r=4, alpha=8))
    return _trained_like(lm.model), lm.tokenizer


def test_linears_in_row_blocks_and_embeddings_as_lookups_compute_as_the_fp32_cast(monkeypatch):
    """At the default block no Linear of a tiny LLaMA is blocked and the embedding looks bf16 rows up: the logits
    are those of ``model.float()``, bit for bit. With a block of 4 KiB every plain Linear computes its output in
    blocks of rows, never from a whole fp32 copy of its weight; BLAS may pick another kernel for a narrow block (on
    MKL: 16-row blocks of 128 columns), so the logits are held to fp32 rounding, not bits (the export's check
    compares two probes computed alike, at a tolerance of 1e-4)."""
    from fedllm.export import upcast

    model, tok = _tiny_llama_bf16()
    ids = tok(["1 + 2 = 3"], return_tensors="pt")
    blocked = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16]
    assert blocked and all(4 * m.weight.numel() > 4096 for m in blocked)
    with torch.no_grad():
        want = copy.deepcopy(model).float()(**ids).logits
        with computed_in_fp32(model):
            assert torch.equal(model(**ids).logits, want)
    monkeypatch.setattr(upcast, "BLOCK_BYTES", 4096)
    upcasts = []
    monkeypatch.setattr(torch.Tensor, "float", lambda t: upcasts.append(t.numel()) or t.to(torch.float32))
    with torch.no_grad():
        with computed_in_fp32(model):
            got = model(**ids).logits
    monkeypatch.undo()
    assert got.dtype == torch.float32
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert max(upcasts) < min(m.weight.numel() for m in blocked)  # no whole fp32 copy of a blocked weight
    assert all("forward" not in vars(m) for m in model.modules())  # the blocked forwards are gone


def test_a_weight_supplied_for_a_module_is_read_for_its_forward_and_dropped_after():
    """``weights``: the module computes with the weight read (as a model holding it would), then holds its own."""
    model, tok = _tiny_llama_bf16()
    ids = tok(["1 + 2 = 3"], return_tensors="pt")
    name, target = next((n, m) for n, m in model.named_modules() if n.endswith("q_proj.base_layer"))
    supplied = torch.randn(target.weight.shape, generator=torch.Generator().manual_seed(1))
    own = target.weight.data
    reads = []
    with torch.no_grad():
        with computed_in_fp32(model, {target: lambda: reads.append(1) or supplied.clone()}):
            got = model(**ids).logits
        holding = copy.deepcopy(model).float()
        holding.get_submodule(name).weight.data = supplied.clone()
        want = holding(**ids).logits
    assert torch.equal(got, want) and reads == [1]
    assert target.weight.data_ptr() == own.data_ptr() and target.weight.dtype == torch.bfloat16
