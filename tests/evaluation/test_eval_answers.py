"""Answer extraction and normalisation on tables of tricky cases."""

import pytest

from fedllm.evaluation.math_answer import extract_math_answer, last_boxed, math_equal, normalize_math_answer
from fedllm.evaluation.numeric_answer import extract_number, numbers_equal

GSM8K_CASES = [
    ("Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7", "7"),                     # reference format
    ("It sells 1,200 * 2 = 2400 pens.\n#### 2,400", "2400"),                 # commas stripped after ####
    ("####   -3", "-3"),                                                     # negative after ####
    ("First 12 then 30. The answer is 42.", "42"),                           # CoT exemplar style, trailing period
    ("So she earns 50 dollars. The answer is: $1,250.50", "1250.50"),        # MetaMathQA style with $ and commas
    ("The final answer is 8", "8"),
    ("He had 10-3=7 left, then bought 5, so 12", "12"),                      # last number; 10-3 is not -3
    ("x = -5", "-5"),
    ("After 2 days: 3/4 of the cake", "3/4"),
    ("The answer is 18. Checking: 9 * 2 = 18, and 20 more", "18"),          # "The answer is" beats the last number
    ("#### 5\nThe answer is 6 and 7", "5"),                                  # #### beats everything
    ("no number at all", None),
    ("Total: 1,000,000.", "1000000"),
]


@pytest.mark.parametrize("text,expected", GSM8K_CASES)
def test_gsm8k_extraction(text, expected):
    assert extract_number(text) == expected


@pytest.mark.parametrize("a,b,equal", [
    ("18", "18.00", True), ("2,400", "2400", True), ("0.5", "1/2", True), ("-3", "3", False),
    ("7", None, False), (None, None, False), ("abc", "7", False), ("1e3", "1000", True),
])
def test_numbers_compare_numerically(a, b, equal):
    assert numbers_equal(a, b) is equal


@pytest.mark.parametrize("text,expected", [
    ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("first \\boxed{1} then \\boxed{\\sqrt{\\frac{3}{4}}}", "\\sqrt{\\frac{3}{4}}"),   # last box, nested braces
    ("$\\boxed 5$", "5"),
    ("\\fbox{x+1}", "x+1"),
    ("\\boxed{unclosed", None),
    ("no box here", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("The answer is: 5\\sqrt{2}.", "5\\sqrt{2}"),        # MetaMathQA fallback
    ("We get $x=3$. The answer is $\\frac{1}{4}$.", "\\frac{1}{4}"),
    ("\\boxed{3} and the answer is 4", "3"),               # a box wins
    ("nothing", None),
])
def test_extract_math_answer(text, expected):
    assert extract_math_answer(text) == expected


@pytest.mark.parametrize("raw,normal", [
    ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("\\tfrac12", "\\frac{1}{2}"),
    ("\\frac1{72}", "\\frac{1}{72}"),
    ("\\left( 3, 4 \\right)", "(3,4)"),
    ("90^\\circ", "90"),
    ("90^{\\circ}", "90"),
    ("\\$5.00", "5.00"),
    ("10\\%", "10"),
    ("5 \\text{ cm}", "5"),
    ("12\\mbox{ inches}", "12"),
    ("x = 3", "3"),
    ("0.5", "\\frac{1}{2}"),
    (".75", "0.75"),
    ("3/4", "\\frac{3}{4}"),
    ("\\sqrt2", "\\sqrt{2}"),
    ("a\\!b", "ab"),
    ("1\n2", "12"),
])
def test_normalize_math_answer(raw, normal):
    assert normalize_math_answer(raw) == normal


@pytest.mark.parametrize("a,b,equal", [
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac{3}{4}", "3/4", True),
    ("\\left(1,2\\right)", "(1, 2)", True),
    ("5\\text{ cm}", "5", True),
    ("x=2", "2", True),
    ("2.50", "\\frac{5}{2}", True),       # compared by value
    ("-\\frac{1}{3}", "-1/3", True),
    ("\\sqrt{2}", "2", False),
    ("3", "4", False),
    (None, "4", False),
])
def test_math_equal(a, b, equal):
    assert math_equal(a, b) is equal
