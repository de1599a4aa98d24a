"""Answer extraction and equivalence on tables of cases with verdicts fixed by hand.

The GSM8K verdicts follow MetaMath's ``eval_gsm8k.py`` (last stated answer) and
lm-evaluation-harness (``####`` first); the MATH verdicts follow what a grader
reading the answers would decide (Hendrycks' ``is_equiv`` gets several of them
wrong: commas, units, symbolic forms).
"""

import pytest

from fedllm.evaluation.math_answer import extract_math_answer, last_boxed, math_equal, plain_number, verify_equal
from fedllm.evaluation.numeric_answer import extract_number, numbers_equal
from fedllm.evaluation.tasks.gsm8k import GSM8K
from fedllm.evaluation.tasks.math_qa import MATH

# (generation, reference solution, expected extracted answer, expected verdict)
GSM8K_TABLE = [
    ("Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7", "#### 7", "7", True),              # reference format
    ("It sells 1,200 * 2 = 2400 pens.\n#### 2,400", "#### 2400", "2400", True),        # commas after ####
    ("####   -3", "#### -3", "-3", True),                                               # negative after ####
    ("First 12 then 30. The answer is 42.", "#### 42", "42", True),                     # trailing full stop
    ("So she earns 50. The answer is: $1,250.50", "#### 1250.5", "1250.50", True),      # MetaMathQA, $ and commas
    ("The final answer is 8", "#### 8", "8", True),
    ("He had 10-3=7 left, then bought 5, so 12", "#### 12", "12", True),                # 10-3 is not -3
    ("x = -5", "#### -5", "-5", True),
    ("After 2 days: 3/4 of the cake", "#### 0.75", "3/4", True),                         # fraction by value
    ("The answer is 18. Checking: 9 * 2 = 18, and 20 more", "#### 18", "18", True),    # stated answer beats last number
    ("#### 5\nThe answer is 6 and 7", "#### 5", "5", True),                             # #### beats everything
    ("no number at all", "#### 3", None, False),                                        # nothing to extract
    ("Total: 1,000,000.", "#### 1000000", "1000000", True),
    ("She needs .5 cups of sugar", "#### 0.5", ".5", True),                             # leading decimal point
    ("The change is -.5 degrees", "#### -0.5", "-.5", True),                            # signed leading decimal
    ("She needs .5 cups of sugar", "#### 5", ".5", False),                              # .5 is not 5
    ("The change is -.5 degrees", "#### 0.5", "-.5", False),                            # -.5 is not 0.5
    ("The answer is 3. Wait, recheck. The answer is 4.", "#### 4", "4", True),          # the last statement wins
    ("The answer is 3. Wait, recheck. The answer is 4.", "#### 3", "4", False),
    ("#### 10\nLet me redo it.\n#### 12", "#### 12", "12", True),                      # last #### wins
    ("The answer is $12.", "#### 12", "12", True),                                      # currency
    ("It costs $ 1,234 in total", "#### 1234", "1234", True),
    ("We get 1,2 and 3", "#### 12", "3", False),                                        # 1,2 is not 1,200-style
    ("18.00 dollars", "#### 18", "18.00", True),                                        # 18.00 == 18
    ("The answer is 18.5.", "#### 18", "18.5", False),
    ("I think 7.", "#### 7", "7", True),                                                # sentence stop, not a decimal
    ("The answer is **42**", "#### 42", "42", True),                                    # markdown bold
    ("The Answer Is: 9", "#### 9", "9", True),                                          # case-insensitive
    ("a) 5 b) 7", "#### 7", "7", True),
    ("(2)-3 makes", "#### -3", "3", False),                                             # minus after ")" is binary
    ("Step 1: 4*5=20\nStep 2: 20+1=21", "#### 21", "21", True),
    ("Step 1: 4*5=20\nStep 2: 20+1=21", "#### 20", "21", False),
    ("The answer is -7", "#### -7", "-7", True),
    ("The answer is -7", "#### 7", "-7", False),
    ("It takes 2.25 hours", "#### 9/4", "2.25", True),
    ("0.1 + 0.2 = 0.3", "#### 0.3", "0.3", True),
    ("Answer: 1,000.", "#### 1000", "1000", True),
    ("", "#### 1", None, False),                                                        # empty generation
    ("The answer is unknown", "#### 0", None, False),                                   # no number at all
    ("The answer is two", "#### 2", None, False),                                       # words are not numbers
    ("#### 72", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72", True),  # a real GSM8K reference
    ("So 5 - 8 = -3. The answer is -3.", "#### -3", "-3", True),
]


@pytest.mark.parametrize("text,reference,extracted,correct", GSM8K_TABLE)
def test_gsm8k_table(text, reference, extracted, correct):
    task = GSM8K()
    assert task.extract(text) == extracted == extract_number(text)
    assert task.equal(task.extract(text), task.gold({"question": "q", "answer": reference})) is correct


def test_gsm8k_table_is_big_enough():
    assert len(GSM8K_TABLE) >= 40
    assert sum(c for *_, c in GSM8K_TABLE) >= 10 and sum(not c for *_, c in GSM8K_TABLE) >= 10


@pytest.mark.parametrize("a,b,equal", [
    ("18", "18.00", True), ("2,400", "2400", True), ("0.5", "1/2", True), ("-3", "3", False),
    ("7", None, False), (None, None, False), ("abc", "7", False), (".5", "0.5", True), ("-.5", "-1/2", True),
])
def test_numbers_compare_numerically(a, b, equal):
    assert numbers_equal(a, b) is equal


# (generation, reference answer, expected extracted answer, expected verdict)
MATH_TABLE = [
    ("so \\boxed{\\frac{1}{2}}.", "0.5", "\\frac{1}{2}", True),
    ("first \\boxed{1} then \\boxed{\\sqrt{\\frac{3}{4}}}", "\\frac{\\sqrt{3}}{2}", "\\sqrt{\\frac{3}{4}}", True),
    ("$\\boxed 5$", "5", "5", True),
    ("\\fbox{x+1}", "1+x", "x+1", True),
    ("\\boxed{unclosed", "1", None, False),                                    # a broken box is no answer
    ("We find 42 apples in total.", "42", None, False),                         # a bare number is no answer
    ("The area is 12, maybe 13", "13", None, False),
    ("The answer is: 5\\sqrt{2}.", "\\sqrt{50}", "5\\sqrt{2}", True),          # MetaMathQA style, symbolic
    ("We get $x=3$. The answer is $\\frac{1}{4}$.", "\\frac14", "\\frac{1}{4}", True),
    ("\\boxed{3} and the answer is 4", "3", "3", True),                         # a box wins
    ("The answer is 3. Then we check it.", "3", "3", True),                     # cut at the sentence end
    ("Final Answer: The final answer is $\\frac{3}{4}$. I hope it is correct.", "0.75", "\\frac{3}{4}", True),
    ("\\boxed{1,2}", "12", "1,2", False),                                       # a list is not twelve
    ("\\boxed{12}", "1,2", "12", False),
    ("\\boxed{1,2}", "2, 1", "1,2", True),                                      # a set of solutions, any order
    ("\\boxed{1,000}", "1000", "1,000", True),                                  # thousands separator
    ("\\boxed{5\\text{cm}}", "5", "5\\text{cm}", True),                         # unit without a space
    ("\\boxed{5 \\text{ cm}}", "5", "5 \\text{ cm}", True),
    ("\\boxed{12\\mbox{ inches}}", "12", "12\\mbox{ inches}", True),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", "2\\sqrt{2}", True),                   # symbolic equivalence
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}", True),  # rationalised
    ("\\boxed{x^2}", "x^{2}", "x^2", True),
    ("\\boxed{x \\in [1,2]}", "[1,2]", "x \\in [1,2]", True),                   # interval with x \in
    ("\\boxed{[1,2)}", "[1,2]", "[1,2)", False),                                # open vs closed end
    ("\\boxed{(1,2)}", "(2,1)", "(1,2)", False),                                # ordered pair
    ("\\boxed{\\left(3, 4\\right)}", "(3,4)", "\\left(3, 4\\right)", True),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac12", "\\dfrac{1}{2}", True),
    ("\\boxed{\\tfrac{3}{4}}", "3/4", "\\tfrac{3}{4}", True),
    ("\\boxed{90^\\circ}", "90", "90^\\circ", True),                            # degrees
    ("\\boxed{\\$5.00}", "5", "\\$5.00", True),                                 # currency
    ("\\boxed{10\\%}", "10", "10\\%", True),                                    # percent
    ("\\boxed{x=2}", "2", "x=2", True),
    ("\\boxed{y = 2x+1}", "2x+1", "y = 2x+1", True),
    ("\\boxed{2.50}", "\\frac{5}{2}", "2.50", True),                            # by value
    ("\\boxed{-\\frac{1}{3}}", "-1/3", "-\\frac{1}{3}", True),
    ("\\boxed{-.5}", "-\\frac{1}{2}", "-.5", True),                             # leading decimal point
    ("\\boxed{\\sqrt{2}}", "2", "\\sqrt{2}", False),
    ("\\boxed{3}", "4", "3", False),
    ("\\boxed{0.333}", "\\frac13", "0.333", False),                             # a rounded value is not exact
    ("\\boxed{\\pi}", "3.14", "\\pi", False),
    ("\\boxed{\\text{Monday}}", "\\text{Monday}", "\\text{Monday}", True),
    ("\\boxed{\\text{(C)}}", "\\text{(C)}", "\\text{(C)}", True),
    ("\\boxed{\\infty}", "-\\infty", "\\infty", False),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", "\\{1,2\\}", True),
    ("\\boxed{}", "0", None, False),                                            # an empty box is no answer
    ("nothing", "1", None, False),
]


@pytest.mark.parametrize("text,reference,extracted,correct", MATH_TABLE)
def test_math_table(text, reference, extracted, correct):
    task = MATH()
    assert task.extract(text) == extracted == extract_math_answer(text)
    assert task.equal(task.extract(text), task.gold({"problem": "p", "solution": f"so $\\boxed{{{reference}}}$"})) \
        is correct


def test_math_table_is_big_enough():
    assert len(MATH_TABLE) >= 40
    assert sum(c for *_, c in MATH_TABLE) >= 10 and sum(not c for *_, c in MATH_TABLE) >= 10


@pytest.mark.parametrize("text,expected", [
    ("first \\boxed{1} then \\boxed{\\sqrt{\\frac{3}{4}}}", "\\sqrt{\\frac{3}{4}}"),   # last box, nested braces
    ("\\boxed{unclosed", None),
    ("no box here", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("a,b", [
    (a, b) for _, b, a, _ in MATH_TABLE
    if a is not None and plain_number(a) is not None and plain_number(b) is not None
] + [("18", "18.00"), ("1/3", "0.333"), ("-7", "7"), ("\\frac{2}{4}", "0.5"), ("1,234", "1234")])
def test_numeric_fast_path_agrees_with_math_verify(a, b):
    assert (plain_number(a) == plain_number(b)) is verify_equal(a, b)


def test_gold_prefers_the_answer_field():
    task = MATH()
    assert task.gold({"problem": "p", "solution": "so \\boxed{2}", "answer": "\\frac{1}{2}"}) == "\\frac{1}{2}"
    assert task.gold({"problem": "p", "solution": "so \\boxed{\\frac{1}{2}}"}) == "\\frac{1}{2}"
    assert math_equal(None, "1") is False


def test_math_reads_the_release_layout_and_the_seven_hub_subjects(tmp_path, monkeypatch):
    """``math`` is the full test set: the original ``test/<subject>/<n>.json`` tree, or the seven
    ``EleutherAI/hendrycks_math`` configs; ``math500`` is the separate 500-problem subset."""
    from fedllm.common.registry import tasks
    from fedllm.evaluation.context import EvalContext
    from fedllm.evaluation.tasks import math_qa
    from fedllm.recipe.schema import EvalConfig

    root = tmp_path / "MATH" / "test"
    for subject, n in (("algebra", 3), ("geometry", 2)):
        (root / subject).mkdir(parents=True)
        for i in (1, 10, 2)[:n]:
            (root / subject / f"{i}.json").write_text(
                f'{{"problem": "{subject} {i}", "solution": "so $\\\\boxed{{{i}}}$", "level": "Level 1"}}')
    ctx = EvalContext(model=None, tokenizer=None, cfg=EvalConfig(data={"math": str(root)}), prompt_style_name="plain")
    rows = MATH().raw_records(ctx)
    assert [r["problem"] for r in rows] == ["algebra 1", "algebra 2", "algebra 10", "geometry 1", "geometry 10"]
    assert [MATH().gold(r) for r in rows] == ["1", "2", "10", "1", "10"]

    asked = []
    monkeypatch.setattr(math_qa, "read_hub", lambda src: asked.append(src) or [{"problem": src.name, "solution": "x"}])
    ctx = EvalContext(model=None, tokenizer=None, cfg=EvalConfig(), prompt_style_name="plain")
    assert len(MATH().raw_records(ctx)) == 7
    assert {(s.path, s.split) for s in asked} == {("EleutherAI/hendrycks_math", "test")}
    assert [s.name for s in asked] == ["algebra", "counting_and_probability", "geometry", "intermediate_algebra",
                                       "number_theory", "prealgebra", "precalculus"]
    assert tasks.get("math500").hub.spec() == "HuggingFaceH4/MATH-500@test"
