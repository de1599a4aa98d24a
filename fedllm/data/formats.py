"""Turn raw records into tokenized examples.

A format is picked by ``DataConfig.format`` from :data:`FORMATS`. Each entry is a
factory ``(tokenizer, data_cfg, max_length, label_names) -> encode`` whose
``encode(record)`` returns an example, or None when nothing of the record is
left to learn from after truncation.

Examples are plain dicts:

* causal formats (``instruction``, ``chat``): ``{"input_ids": [...], "labels": [...]}``
  with ``labels == -100`` wherever no loss is taken (prompt, user turns, template text);
* ``classification``: ``{"input_ids": [...], "label": int}``.

Truncation of ``instruction`` examples keeps the response: when prompt plus
response exceed ``max_length``, the prompt gives up tokens from its *left* end
(keeping "### Response:" next to the response) until it is down to half of the
window; only then is the response cut at its right end. BOS, when the tokenizer
adds one, always stays at position 0. ``chat`` examples are cut at the right end;
``classification`` examples use the tokenizer's own truncation.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from fedllm.data.chat import chat_encoder
from fedllm.data.errors import DataError
from fedllm.data.preference import preference_encoder
from fedllm.data.templates import (
    INSTRUCTION_TEMPLATES,
    format_prompt,
    format_response,
    instruction_template,
    record_field,
)
from fedllm.data.tokens import IGNORE_INDEX, leading_bos, text_ids
from fedllm.recipe.schema import DataConfig

Encoder = Callable[[dict], Optional[dict]]


def fit_prompt_response(prompt: list[int], response: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Truncate a prompt/response pair to ``budget`` tokens, keeping the response.

    The prompt loses tokens from its left end down to ``min(len(prompt),
    budget // 2)``; the response is cut at its right end only after that.

    Args:
        prompt: Prompt token ids.
        response: Response token ids.
        budget: Largest total length.

    Returns:
        The kept ``(prompt, response)`` ids.
    """
    if len(prompt) + len(response) <= budget:
        return prompt, response
    keep_prompt = max(budget - len(response), min(len(prompt), budget // 2))
    keep_response = budget - keep_prompt
    return prompt[len(prompt) - keep_prompt :], response[:keep_response]


def format_alpaca_prompt(instruction: str, input: str = "") -> str:
    """The ``alpaca`` prompt of one instruction (no-input variant when ``input`` is empty).

    Args:
        instruction: The instruction text.
        input: Optional context.

    Returns:
        The prompt, ending where the response starts.
    """
    return INSTRUCTION_TEMPLATES["alpaca"].prompt(instruction, input or "")


def instruction_encoder(tokenizer: Any, data_cfg: DataConfig, max_length: int, label_names: Optional[list[str]] = None) -> Encoder:
    """Encoder of instruction records (Alpaca-style prompt, loss on ``output`` + EOS only).

    The prompt and the response are tokenized separately and concatenated, so
    the boundary between them is exact; except after a prompt that ends in a
    space (the ``openfedllm`` and ``flowertune_*`` templates' ``"### Response: "``),
    where the whole text is tokenized as OpenFedLLM's and FlowerTune's trainers
    (trl) tokenize it, and the tokens that hold answer characters are the
    response (:func:`joint_prompt_response`): the space then joins the first
    answer word (``:`` ``ĠTom``, not ``:`` ``Ġ`` ``Tom``).

    Args:
        tokenizer: A Hugging Face tokenizer.
        data_cfg: Template name and column renames.
        max_length: Longest example in tokens.
        label_names: Unused.

    Returns:
        ``encode(record) -> {"input_ids", "labels"}`` (None when no response token fits).
    """
    instruction_template(data_cfg.template)  # fail early on an unknown name
    bos = leading_bos(tokenizer)
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    budget = max_length - len(bos)
    if budget < 1:
        raise DataError(f"max_length {max_length} leaves no room for a response token")

    def encode(record: dict) -> Optional[dict]:
        prompt_text, response_text = format_prompt(record, data_cfg), format_response(record, data_cfg)
        if prompt_text.endswith(" ") and response_text and getattr(tokenizer, "is_fast", False):
            prompt, response = joint_prompt_response(tokenizer, prompt_text, response_text)
        else:
            prompt, response = text_ids(tokenizer, prompt_text), text_ids(tokenizer, response_text)
        response = response + eos
        prompt, response = fit_prompt_response(prompt, response, budget)
        if not response:
            return None
        return {
            "input_ids": bos + prompt + response,
            "labels": [IGNORE_INDEX] * (len(bos) + len(prompt)) + response,
        }

    return encode


def joint_prompt_response(tokenizer: Any, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """``(prompt ids, response ids)`` of ``prompt + response`` tokenized as one text (no special tokens): the
    response is every token from the first one that ends after the prompt's last character (a token holding the
    prompt's trailing space and the answer's first letters is the answer's)."""
    enc = tokenizer(prompt + response, add_special_tokens=False, return_offsets_mapping=True)
    ids, ends = list(enc["input_ids"]), [end for _, end in enc["offset_mapping"]]
    cut = next((i for i, end in enumerate(ends) if end > len(prompt)), len(ids))
    return ids[:cut], ids[cut:]


def resolve_label_names(records: list[dict], data_cfg: DataConfig) -> list[str]:
    """Class names of a classification data set.

    ``DataConfig.labels`` when given; otherwise, for integer labels, ``"0" ..
    str(max)`` (the integers are the class ids); for string labels, the sorted
    distinct values.

    Args:
        records: Every record whose label must be covered (train and held-out).
        data_cfg: Label column rename and optional label names.

    Returns:
        The class names; class id ``i`` is ``names[i]``.

    Raises:
        DataError: Negative, mixed-type or non-scalar labels.
    """
    if data_cfg.labels:
        return list(data_cfg.labels)
    values = {_scalar_label(record_field(r, data_cfg, "label")) for r in records}
    if all(isinstance(v, int) for v in values):
        if min(values) < 0:
            raise DataError(f"integer labels must be >= 0; got {min(values)} (give data.labels to name classes)")
        return [str(i) for i in range(max(values) + 1)]
    if all(isinstance(v, str) for v in values):
        return sorted(values)
    raise DataError(f"labels mix types ({sorted({type(v).__name__ for v in values})}); give data.labels")


def _scalar_label(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, (int, str)):
        return value
    raise DataError(f"a label must be an integer or a string; got {value!r}")


def label_id(value: Any, label_names: list[str], index: Optional[dict[str, int]] = None) -> int:
    """Class id of a raw label: integers are kept, strings are looked up in ``label_names``.

    Args:
        value: The record's label.
        label_names: Class names.
        index: ``{name: id}`` of ``label_names`` (built when not given).

    Returns:
        The class id.

    Raises:
        DataError: Out-of-range integer or unknown name.
    """
    value = _scalar_label(value)
    if isinstance(value, int):
        if not 0 <= value < len(label_names):
            raise DataError(f"label {value} is out of range for {len(label_names)} classes {label_names}")
        return value
    index = index if index is not None else {n: i for i, n in enumerate(label_names)}
    if value not in index:
        raise DataError(f"label {value!r} is not one of the class names {label_names} (data.labels)")
    return index[value]


def classification_encoder(tokenizer: Any, data_cfg: DataConfig, max_length: int, label_names: Optional[list[str]] = None) -> Encoder:
    """Encoder of classification records (``text``, optional ``text_pair``, ``label``).

    Args:
        tokenizer: A Hugging Face tokenizer (its special tokens are added, e.g. CLS/SEP).
        data_cfg: Column renames.
        max_length: Longest example in tokens.
        label_names: Class names from :func:`resolve_label_names`.

    Returns:
        ``encode(record) -> {"input_ids", "label"}``.
    """
    if not label_names:
        raise DataError("the classification format needs label names (see resolve_label_names)")
    index = {n: i for i, n in enumerate(label_names)}

    def encode(record: dict) -> dict:
        texts = [str(record_field(record, data_cfg, "text"))]
        pair = record_field(record, data_cfg, "text_pair", required=False)
        if pair is not None:
            texts.append(str(pair))
        ids = tokenizer(*texts, truncation=True, max_length=max_length)["input_ids"]
        return {"input_ids": list(ids), "label": label_id(record_field(record, data_cfg, "label"), label_names, index)}

    return encode


#: Format name -> encoder factory.
FORMATS: dict[str, Callable[..., Encoder]] = {
    "instruction": instruction_encoder,
    "chat": chat_encoder,
    "classification": classification_encoder,
    "preference": preference_encoder,
}

#: Format name -> the model task it trains.
FORMAT_TASKS: dict[str, str] = {"instruction": "causal_lm", "chat": "causal_lm", "classification": "classification",
                                 "preference": "causal_lm"}


def make_encoder(tokenizer: Any, data_cfg: DataConfig, max_length: int, label_names: Optional[list[str]] = None) -> Encoder:
    """The encoder of ``data_cfg.format``.

    Raises:
        DataError: Unknown format.
    """
    if data_cfg.format not in FORMATS:
        raise DataError(f"unknown data.format {data_cfg.format!r}; known: {', '.join(sorted(FORMATS))}")
    return FORMATS[data_cfg.format](tokenizer, data_cfg, max_length, label_names)


def encode_records(
    records: list[dict], tokenizer: Any, data_cfg: DataConfig, max_length: int, label_names: Optional[list[str]] = None
) -> list[dict]:
    """Tokenize ``records``, leaving out those with nothing to learn after truncation.

    Args:
        records: Raw records.
        tokenizer: A Hugging Face tokenizer.
        data_cfg: Format, template and column renames.
        max_length: Longest example in tokens.
        label_names: Class names (classification).

    Returns:
        The examples, in record order.
    """
    encode = make_encoder(tokenizer, data_cfg, max_length, label_names)
    return [ex for ex in map(encode, records) if ex is not None]
