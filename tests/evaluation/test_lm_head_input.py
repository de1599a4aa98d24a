"""The LM head reads a contiguous input (fedllm.models.lm_head_input): generation's prompt pass gives the head
``hidden_states[:, -1:, :]``, which torch's CPU ``F.linear`` multiplies through a copy of the weight per row."""

import torch

from fedllm.evaluation.generation import generate_completions
from fedllm.models.lm_head_input import MARK, keep_lm_head_input_contiguous
from fedllm.models.loading import load_base_model, load_tokenizer
from fedllm.recipe.schema import ModelConfig

PROMPTS = ["What is 3 + 4?", "A basket has 67 marbles and gets 85 more. How many marbles are in it now?"]


def head_inputs(model) -> list[bool]:
    """Record, call by call, whether the LM head's forward got a contiguous input (after every pre-hook)."""
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].is_contiguous()))
    return seen


def test_loaded_models_give_their_head_a_contiguous_input_and_the_same_logits_and_tokens():
    cfg = ModelConfig(name="tiny-llama", dtype="bf16")
    tok = load_tokenizer(cfg)
    plain = load_base_model(ModelConfig(name="tiny-llama", dtype="fp32"), tok).to(torch.bfloat16).eval()
    head = plain.get_output_embeddings()
    head._forward_pre_hooks.clear()  # the same model without fedllm's hook
    setattr(head, MARK, False)
    hooked = load_base_model(cfg, tok).eval()
    assert getattr(hooked.get_output_embeddings(), MARK) and len(hooked.get_output_embeddings()._forward_pre_hooks) == 1
    keep_lm_head_input_contiguous(hooked)  # once only
    assert len(hooked.get_output_embeddings()._forward_pre_hooks) == 1
    seen_plain, seen_hooked = head_inputs(plain), head_inputs(hooked)
    tok.padding_side = "left"
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        want, got = plain(**enc, logits_to_keep=1).logits, hooked(**enc, logits_to_keep=1).logits
        assert seen_plain == [False] and seen_hooked == [True]  # the prompt pass's slice, made contiguous
        assert torch.equal(got, want)
        kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": tok.pad_token_id}
        assert torch.equal(hooked.generate(**enc, **kwargs), plain.generate(**enc, **kwargs))


def test_generation_hooks_a_model_fedllm_did_not_load():
    import transformers

    cfg = ModelConfig(name="tiny-llama", dtype="fp32")
    tok = load_tokenizer(cfg)
    model = transformers.AutoModelForCausalLM.from_config(load_base_model(cfg, tok).config)
    assert not getattr(model.get_output_embeddings(), MARK, False)
    seen = head_inputs(model)
    out = generate_completions(model, tok, PROMPTS, 3, 2)
    assert len(out) == 2 and getattr(model.get_output_embeddings(), MARK)
    assert seen[0] is True  # the prompt pass's slice reached the head contiguous


def test_a_model_without_an_lm_head_is_left_alone():
    class Classifier(torch.nn.Module):
        def get_output_embeddings(self):
            return None

    keep_lm_head_input_contiguous(Classifier())  # nothing to hook, no error
    keep_lm_head_input_contiguous(torch.nn.Linear(2, 2))  # no get_output_embeddings at all
