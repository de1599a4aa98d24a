"""How the judged benchmarks were run by the code the papers used: answer sampling and judge prompts.

Three reference implementations, read line by line (none is imported or copied):

- FastChat ``llm_judge`` (MT-Bench; ``vicuna_bench``): answers sampled at a
  per-category temperature (writing/roleplay 0.7, STEM/humanities 0.1, extraction,
  math, coding, reasoning 0, any other category 0.7; greedy at 0), up to 1,024 new
  tokens, ``torch.manual_seed(0)`` for the first choice; graded by FastChat's
  single-answer prompts (``judge_prompts.jsonl``) at temperature 0, against the
  GPT-4 reference answers for math, reasoning and coding.
- OpenFedLLM ``evaluation/open_ended`` (Vicuna, the numbers the FRLoRA paper
  reports): answers sampled at temperature 0.7, top-p 1.0, up to 2,048 new tokens;
  graded by its own single-answer prompt (below), no reference answers, judge
  temperature 0.2, up to 2,048 reply tokens.
- FedLLM-Bench ``evaluation/open_ended`` (Ref-GPT4 on a fixed ``testset.json``):
  answers sampled at temperature 0.7, top-p 1.0, up to 1,024 new tokens; graded by
  its own single-answer prompt (below), no reference answers, judge temperature 0.2,
  up to 2,048 reply tokens.

All three parse ``[[x]]``, else ``[x]`` from the judge's reply
(:func:`~fedllm.evaluation.judge_prompts.parse_rating`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

FASTCHAT_TEMPERATURES = {
    "writing": 0.7, "roleplay": 0.7, "extraction": 0.0, "math": 0.0, "coding": 0.0, "reasoning": 0.0,
    "stem": 0.1, "humanities": 0.1, "arena-hard-200": 0.0,
}
"""FastChat's ``temperature_config`` (``gen_model_answer.py``): answer temperature per MT-Bench category."""


@dataclass(frozen=True)
class AnswerSampling:
    """How a benchmark's reference code generated the model's answers.

    Attributes:
        default_temperature: temperature of a category not in ``temperatures``.
        max_new_tokens: generation limit.
        temperatures: per-category temperatures (0: greedy).
        top_p: nucleus mass when sampling; None: the model's generation config (FastChat passes none).
    """

    default_temperature: float
    max_new_tokens: int
    temperatures: dict[str, float] = field(default_factory=dict)
    top_p: Optional[float] = 1.0

    def temperature(self, category: str) -> float:
        """The answer temperature of a question of ``category``."""
        return self.temperatures.get(category, self.default_temperature)


FASTCHAT_SAMPLING = AnswerSampling(0.7, 1024, FASTCHAT_TEMPERATURES, top_p=None)
"""FastChat's ``gen_model_answer.py`` (MT-Bench, ``vicuna_bench``; OpenFedLLM's ``gen_model_answer_mt.py``):
``model.generate(do_sample=..., temperature=..., max_new_tokens=...)``, top-p and top-k from the model's
generation config, ``torch.manual_seed(0)`` before each question."""

OPENFEDLLM_ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction} \n\n### Response:"
)
"""The answer prompt of OpenFedLLM's ``gen_model_answer.py`` (Vicuna) and FedLLM-Bench's
``gen_answer_bench.py`` (Ref-GPT4): their ``utils/template.py`` ``alpaca_template`` formatted with the
instruction and two empty strings, its last character (a space) cut off -- note the space after the
instruction. Generation stops only at the end-of-sequence token (no stop string)."""

OPENFEDLLM_VICUNA_SAMPLING = AnswerSampling(0.7, 2048)
"""OpenFedLLM's ``gen_model_answer.py`` for Vicuna."""

FEDLLM_BENCH_SAMPLING = AnswerSampling(0.7, 1024)
"""FedLLM-Bench's ``gen_answer_bench.py`` for the ``testset.json`` benchmarks (Ref-GPT4)."""


@dataclass(frozen=True)
class SingleAnswerPrompt:
    """A single-answer grading prompt without reference answers (OpenFedLLM, FedLLM-Bench).

    Attributes:
        name: recorded with each judgment.
        system: the system message.
        template: the user message, with ``{question}`` and ``{answer}``.
        temperature: the judge's sampling temperature.
    """

    name: str
    system: str
    template: str
    temperature: float

    def messages(self, question: str, answer: str) -> list[dict]:
        """The chat messages sent to the judge for one answer."""
        return [{"role": "system", "content": self.system},
                {"role": "user", "content": self.template.format(question=question, answer=answer)}]


_GRADING = (
    "Your evaluation should consider factors such as the helpfulness, relevance, accuracy, depth, creativity, "
    "and level of detail of the response. Begin your evaluation by providing a short explanation. Be as "
    "objective as possible. After providing your explanation, you must rate the response on a scale of 1 to 10 "
    "by strictly following this format: \"[[rating]]\", for example: \"Rating: [[5]]\"."
)
_QA = "\n\n[Question]\n{question}\n\n[The Start of Assistant's Answer]\n{answer}\n[The End of Assistant's Answer]"

OPENFEDLLM_VICUNA_PROMPT = SingleAnswerPrompt(
    name="openfedllm-vicuna",
    system="You are a helpful assistant, that ranks models by the quality of their answers.",
    template="[Instruction]\nPlease act as an impartial judge and evaluate the quality of the response provided by "
             "an AI assistant to the user question displayed below. " + _GRADING + _QA,
    temperature=0.2,
)
"""OpenFedLLM's ``gen_judge_vicuna.py`` prompt."""

FEDLLM_BENCH_PROMPT = SingleAnswerPrompt(
    name="fedllm-bench-single",
    system="You are a helpful assistant, that rates models by the quality of their answers.",
    template="[Instruction]\nPlease act as an impartial judge and evaluate the quality of the response provided by "
             "an AI assistant to the user's instruction displayed below. " + _GRADING + " " + _QA,
    temperature=0.2,
)
"""FedLLM-Bench's ``gen_judge_bench.py`` prompt (note the space before the blank line, as in the original)."""

FASTCHAT_JUDGE_TEMPERATURE = 0.0
"""FastChat's judge temperature (``chat_completion_openai(..., temperature=0, max_tokens=2048)``)."""
