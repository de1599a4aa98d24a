"""Instruction prompt templates and field lookup through ``DataConfig.fields``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedllm.data.errors import DataError
from fedllm.recipe.schema import DataConfig


@dataclass(frozen=True)
class InstructionTemplate:
    """A prompt with and without an input; the response follows the prompt directly.

    Attributes:
        with_input: Prompt text with ``{instruction}`` and ``{input}`` slots.
        no_input: Prompt text with an ``{instruction}`` slot.
    """

    with_input: str
    no_input: str

    def prompt(self, instruction: str, input: str = "") -> str:
        """The prompt text; the no-input variant when ``input`` is empty (as in Alpaca)."""
        if input != "":
            return self.with_input.format(instruction=instruction, input=input)
        return self.no_input.format(instruction=instruction)


_ALPACA_HEAD_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
)
_FLOWERTUNE_HEAD = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n"
_ALPACA_HEAD = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"

#: Instruction templates by ``DataConfig.template`` name.
INSTRUCTION_TEMPLATES: dict[str, InstructionTemplate] = {
    # The Alpaca prompt with a newline after "### Response:" (tloen/alpaca-lora's templates/alpaca.json).
    "alpaca": InstructionTemplate(
        with_input=_ALPACA_HEAD_INPUT + "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
        no_input=_ALPACA_HEAD + "### Instruction:\n{instruction}\n\n### Response:\n",
    ),
    # Verbatim PROMPT_DICT of tatsu-lab/stanford_alpaca train.py: no newline after "### Response:".
    "stanford_alpaca": InstructionTemplate(
        with_input=_ALPACA_HEAD_INPUT + "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:",
        no_input=_ALPACA_HEAD + "### Instruction:\n{instruction}\n\n### Response:",
    ),
    # OpenFedLLM / FedLLM-Bench's utils/template.py alpaca_template ("...### Instruction:\n{} \n\n### Response: {}{}",
    # note the space after the instruction) with their alpaca_format(): instruction + " " + input when input is
    # not empty; the response follows "### Response: " and the EOS closes it, as in their SFT text.
    "openfedllm": InstructionTemplate(
        with_input=_ALPACA_HEAD + "### Instruction:\n{instruction} {input} \n\n### Response: ",
        no_input=_ALPACA_HEAD + "### Instruction:\n{instruction} \n\n### Response: ",
    ),
    # FlowerTune's formatting_prompts_func (flwrlabs/flower examples/flowertune-llm-*/…/dataset.py): single newlines,
    # "### Response: " then the response. General NLP and medical prompt with the instruction column alone (medical
    # maps its 'input' question there with data.fields); finance and code with instruction + " " + input, the space
    # kept when the input is empty ("flowertune_input").
    "flowertune": InstructionTemplate(
        with_input=_FLOWERTUNE_HEAD + "### Instruction:\n{instruction}\n### Response: ",
        no_input=_FLOWERTUNE_HEAD + "### Instruction:\n{instruction}\n### Response: ",
    ),
    "flowertune_input": InstructionTemplate(
        with_input=_FLOWERTUNE_HEAD + "### Instruction:\n{instruction} {input}\n### Response: ",
        no_input=_FLOWERTUNE_HEAD + "### Instruction:\n{instruction} \n### Response: ",
    ),
}

def field_name(data_cfg: DataConfig, key: str) -> str:
    """The record column holding the canonical field ``key`` (``DataConfig.fields`` renames it).

    Args:
        data_cfg: The data section of the recipe.
        key: Canonical name: instruction, input, output, messages, conversations,
            text, text_pair or label.

    Returns:
        The column name in the records.
    """
    return data_cfg.fields.get(key, key)


def record_field(record: dict, data_cfg: DataConfig, key: str, required: bool = True) -> Any:
    """The value of canonical field ``key`` in ``record``.

    Args:
        record: One raw record.
        data_cfg: The data section of the recipe (for column renames).
        key: Canonical field name (see :func:`field_name`).
        required: Raise when the column is missing; otherwise return None.

    Returns:
        The value, or None for a missing optional column.

    Raises:
        DataError: A required column is missing; the message lists the record's columns.
    """
    column = field_name(data_cfg, key)
    if column not in record:
        if not required:
            return None
        hint = f" (renamed from {key!r} by data.fields)" if column != key else ""
        raise DataError(
            f"record has no column {column!r}{hint}; its columns are {sorted(record)}. "
            f"Map it with data.fields, e.g. {{{key}: <column>}}"
        )
    return record[column]


def instruction_template(name: str) -> InstructionTemplate:
    """The instruction template registered as ``name``.

    Raises:
        DataError: Unknown name; the message lists the known ones.
    """
    if name not in INSTRUCTION_TEMPLATES:
        raise DataError(
            f"unknown instruction template {name!r} (data.template); known: {', '.join(sorted(INSTRUCTION_TEMPLATES))}"
        )
    return INSTRUCTION_TEMPLATES[name]


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def format_prompt(record: dict, data_cfg: DataConfig) -> str:
    """The instruction prompt of ``record`` without its response.

    Evaluation uses this to prompt a model on held-out records exactly as the
    model was prompted in training.

    Args:
        record: A raw record with instruction (and optional input) columns.
        data_cfg: The data section of the recipe (template and column renames).

    Returns:
        The prompt text, ending where the response starts.

    Raises:
        DataError: Unknown template or missing instruction column.
    """
    template = instruction_template(data_cfg.template)
    instruction = _text(record_field(record, data_cfg, "instruction"))
    return template.prompt(instruction, _text(record_field(record, data_cfg, "input", required=False)))


def format_response(record: dict, data_cfg: DataConfig) -> str:
    """The response text of an instruction record (its output column), without EOS.

    Raises:
        DataError: Missing output column.
    """
    return _text(record_field(record, data_cfg, "output"))
