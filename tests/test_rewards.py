"""Reward functions: exact scores on hand-written correct, wrong, malformed and adversarial completions."""

import time
from fractions import Fraction

import pytest

from trl_diffusion.rewards import (
    REWARD_FUNCS,
    code_reward,
    code_solved,
    completion_text,
    countdown_accuracy,
    countdown_reward,
    evaluate_arithmetic,
    extract_answer,
    extract_code,
    format_reward,
    gsm8k_reward,
    largest_digit_reward,
    last_boxed,
    math_reward,
    parse_arithmetic,
    parse_gsm8k_answer,
    run_tests,
    soft_format_reward,
    sudoku_reward,
    sudoku_solved,
)


def test_reward_registry_holds_exactly_the_reward_functions():
    assert set(REWARD_FUNCS) == {
        "code_reward",
        "code_solved",
        "countdown_accuracy",
        "countdown_reward",
        "format_reward",
        "gsm8k_reward",
        "largest_digit_reward",
        "math_reward",
        "soft_format_reward",
        "sudoku_reward",
        "sudoku_solved",
    }
    for name, func in REWARD_FUNCS.items():
        assert func.__name__ == name
        assert func(completions=["x"], prompts=["p"], completion_ids=[[1]], trainer_state=None) in ([0.0], [None])


def conversational(text):
    return [{"role": "assistant", "content": text}]


# ---------------------------------------------------------------------------------------------------------------
# Reading completions


def test_completion_text_reads_both_forms():
    assert completion_text("plain") == "plain"
    assert completion_text(conversational("chat")) == "chat"
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]) == "ab"
    # The last assistant message is the answer; tool output does not count.
    tool_call = [{"role": "assistant", "content": "x"}, {"role": "tool", "content": "<answer>1</answer>"}]
    assert completion_text(tool_call) == "x"
    assert completion_text([{"role": "tool", "content": "t"}]) == ""


def test_extract_answer_and_boxed():
    assert extract_answer("<answer> 1 </answer> then <answer>\n2\n</answer>") == "2"  # the last one, stripped
    assert extract_answer("<answer>a<answer>b</answer>") == "b"
    assert extract_answer("<answer>unclosed") is None
    assert extract_answer("</answer> closed before <answer>") is None
    assert last_boxed(r"\boxed{1} and \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed{unbalanced") is None
    assert last_boxed("nothing") is None


@pytest.mark.parametrize(
    "text",
    ["<answer>" * 30_000, "<answer>" * 30_000 + "</answer>", "```\n" * 50_000, r"\boxed{" * 30_000, "1," * 100_000],
)
def test_text_rewards_take_linear_time_on_adversarial_text(text):
    start = time.perf_counter()
    countdown_reward([text], numbers=[[1, 2]], target=[3])
    sudoku_reward([text], puzzle=["0" * 16], solution=["1" * 16])
    gsm8k_reward([text], answer=["1"])
    format_reward([text])
    soft_format_reward([text])
    extract_code(text)
    assert time.perf_counter() - start < 2.0  # a quadratic scan of these would take minutes


# ---------------------------------------------------------------------------------------------------------------
# Countdown

NUMBERS, TARGET = [44, 19, 35], 28

COUNTDOWN_CASES = [
    # correct: 1.0
    ("<answer>(44 + 19) - 35</answer>", NUMBERS, TARGET, 1.0),
    ("<reasoning>try</reasoning>\n<answer>\n44 - 35 + 19\n</answer>", NUMBERS, TARGET, 1.0),
    ("<answer>-35 + 44 + 19</answer>", NUMBERS, TARGET, 1.0),  # a unary sign is allowed
    ("<answer>(6 / 4) * 8</answer>", [4, 6, 8], 12, 1.0),  # exact rational intermediates
    ("<answer>5 + 5 + 2</answer>", [5, 2, 5], 12, 1.0),  # a repeated number, used as often as given
    (r"<answer>\boxed{(44 + 19) - 35}</answer>", NUMBERS, TARGET, 1.0),  # d1's evaluation prompt boxes it
    ("<answer>1 + 1</answer> no, <answer>(44 + 19) - 35</answer>", NUMBERS, TARGET, 1.0),  # the last answer counts
    # well-formed but wrong: 0.1
    ("<answer>44 + 19 + 35</answer>", NUMBERS, TARGET, 0.1),  # wrong value
    ("<answer>44 - 35 + 19 + 0 * 19</answer>", NUMBERS, TARGET, 0.1),  # a number used twice (and an extra 0)
    ("<answer>(44 + 19) - 35 + 0</answer>", NUMBERS, TARGET, 0.1),  # an extra number
    ("<answer>44 - 16</answer>", NUMBERS, TARGET, 0.1),  # numbers missing
    ("<answer>1 / 0 + 5</answer>", [1, 0, 5], 5, 0.1),  # division by zero
    ("<answer>5 + 5 + 2</answer>", [5, 2, 2], 12, 0.1),  # 5 given once, used twice
    # no answer, or not an arithmetic expression: 0.0
    ("(44 + 19) - 35", NUMBERS, TARGET, 0.0),
    ("<answer></answer>", NUMBERS, TARGET, 0.0),
    ("<answer>(44 + 19) - 35 = 28</answer>", NUMBERS, TARGET, 0.0),  # the prompt forbids "= target"
    ("<answer>__import__('os')</answer>", NUMBERS, TARGET, 0.0),
    ("<answer>__import__('os').system('echo pwned')</answer>", NUMBERS, TARGET, 0.0),
    ("<answer>2**99999999</answer>", NUMBERS, TARGET, 0.0),
    ("<answer>9**9**9**9</answer>", NUMBERS, TARGET, 0.0),
    ("<answer>44 // 19 + 35</answer>", NUMBERS, TARGET, 0.0),
    ("<answer>True + 27</answer>", [1, 27], TARGET, 0.0),
    ("<answer>1e999 - 1e999</answer>", NUMBERS, TARGET, 0.0),
    ("<answer>x + 1</answer>", NUMBERS, TARGET, 0.0),
    ("<answer>'28'</answer>", NUMBERS, TARGET, 0.0),
    ("<answer>" + "1+" * 5000 + "1</answer>", NUMBERS, TARGET, 0.0),  # over-long
    ("<answer>" + "(" * 300 + "1" + ")" * 300 + "</answer>", NUMBERS, TARGET, 0.0),  # nested too deep to parse
]


@pytest.mark.parametrize("completion, numbers, target, expected", COUNTDOWN_CASES)
def test_countdown_reward_exact_values(completion, numbers, target, expected):
    start = time.perf_counter()
    assert countdown_reward([completion], numbers=[numbers], target=[target]) == [expected]
    assert countdown_reward([conversational(completion)], numbers=[numbers], target=[target]) == [expected]
    assert countdown_accuracy([completion], numbers=[numbers], target=[target]) == [float(expected == 1.0)]
    assert time.perf_counter() - start < 1.0  # nothing is evaluated by brute force


def test_countdown_evaluator_is_exact_and_restricted():
    assert evaluate_arithmetic(parse_arithmetic("(1 / 3) * 3")) == 1
    assert evaluate_arithmetic(parse_arithmetic("-(2 - 7) / 2")) == Fraction(5, 2)
    with pytest.raises(ZeroDivisionError):
        evaluate_arithmetic(parse_arithmetic("1 / (2 - 2)"))
    for malformed in ("2 ** 3", "abs(-1)", "[1]", "1 if 1 else 2", "1 < 2", "a", "1; 2", "lambda: 1", "1 % 2"):
        with pytest.raises(ValueError):
            parse_arithmetic(malformed)


def test_countdown_reward_does_not_apply_without_columns():
    completions = ["<answer>(44 + 19) - 35</answer>"] * 3
    assert countdown_reward(completions, numbers=[NUMBERS, None, NUMBERS], target=[TARGET, TARGET, None]) == [
        1.0,
        None,
        None,
    ]
    assert countdown_reward(completions) == [None, None, None]  # e.g. a GSM8K dataset: no such columns
    assert countdown_accuracy(completions, numbers=[None] * 3, target=[TARGET] * 3) == [None, None, None]


# ---------------------------------------------------------------------------------------------------------------
# Sudoku

PUZZLE, SOLUTION = "0000304210000401", "4213314213242431"  # 10 empty cells, unique solution


@pytest.mark.parametrize(
    "completion, cell_score, solved",
    [
        ("<answer>4213314213242431</answer>", 1.0, 1.0),
        ("<answer>\n4213\n3142\n1324\n2431\n</answer>", 1.0, 1.0),  # separators are ignored
        ("<answer>4 2 1 3 | 3 1 4 2 | 1 3 2 4 | 2 4 3 1</answer>", 1.0, 1.0),
        ("<answer>2413314213242431</answer>", 0.8, 0.0),  # two empty cells wrong
        ("<answer>4213314213242413</answer>", 0.9, 0.0),  # one empty cell and one given wrong: givens don't score
        ("<answer>0000304210000401</answer>", 0.0, 0.0),  # the puzzle copied back
        ("<answer>421331421324243</answer>", 0.0, 0.0),  # 15 digits: wrong shape
        ("<answer>42133142132424311</answer>", 0.0, 0.0),  # 17 digits: wrong shape
        ("<answer>4213\n3142\n1324</answer>", 0.0, 0.0),  # 3 rows
        ("4213314213242431", 0.0, 0.0),  # no answer tags
    ],
)
def test_sudoku_reward_exact_values(completion, cell_score, solved):
    for form in (completion, conversational(completion)):
        assert sudoku_reward([form], puzzle=[PUZZLE], solution=[SOLUTION]) == [pytest.approx(cell_score)]
        assert sudoku_solved([form], puzzle=[PUZZLE], solution=[SOLUTION]) == [solved]


def test_sudoku_reward_9x9_and_inapplicable_rows():
    solution = "196285734574631892328479615419857263867923541253164978731592486985346127642718359"
    puzzle = "100085700070000002000409605410000200807000000253104070730002000985340020000700000"
    wrong_first_empty = solution[0] + ("1" if solution[1] != "1" else "2") + solution[2:]
    empty = puzzle.count("0")
    scores = sudoku_reward(
        [f"<answer>{solution}</answer>", f"<answer>{wrong_first_empty}</answer>", f"<answer>{solution[:80]}</answer>"],
        puzzle=[puzzle] * 3,
        solution=[solution] * 3,
    )
    assert scores == [1.0, pytest.approx((empty - 1) / empty), 0.0]
    assert sudoku_reward(["<answer>1</answer>"] * 2, puzzle=[None, PUZZLE], solution=[SOLUTION, None]) == [None, None]
    assert sudoku_solved(["<answer>1</answer>"]) == [None]


# ---------------------------------------------------------------------------------------------------------------
# Math


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        (r"<answer>\boxed{\frac{1}{2}}</answer>", "0.5", 1.0),
        ("<answer>0.5</answer>", r"\frac{1}{2}", 1.0),
        (r"<reasoning>half</reasoning><answer>The answer is $\frac{1}{2}$.</answer>", "0.5", 1.0),
        (r"so the result is \boxed{\frac{1}{2}}.", r"\frac12", 1.0),  # no answer tag: the last \boxed{}
        (r"<answer>\boxed{(3, \frac{\pi}{2})}</answer>", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
        (r"<answer>\boxed{x^2+7x+10}</answer>", "(x+2)(x+5)", 1.0),
        (r"<answer>\boxed{\frac{1}{3}}</answer>", "0.5", 0.0),
        ("<answer>0.49</answer>", "0.5", 0.0),
        (r"I think 1/2 is likely", "0.5", 0.0),  # no answer tag and no anchored LaTeX
        ("<answer></answer>", "0.5", 0.0),
    ],
)
def test_math_reward_exact_values(completion, gold, expected):
    assert math_reward([completion], answer=[gold]) == [expected]
    assert math_reward([conversational(completion)], answer=[gold]) == [expected]


def test_math_reward_does_not_apply_without_a_gold_answer():
    assert math_reward([r"\boxed{1}"] * 2, answer=[None, ""]) == [None, None]
    assert math_reward([r"\boxed{1}"]) == [None]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<answer>\n72\n</answer>", 72.0),
        ("<answer>$1,234.50</answer>", 1234.5),
        ("<answer>It is -3 degrees, not 4.</answer>", 4.0),  # the last number of the answer block
        (r"<answer>\boxed{18} dollars, 3 times</answer>", 18.0),  # its \boxed{} first
        (r"Then \boxed{42}. Later 7", 42.0),
        ("So the answer is: 1,000 apples, after 3 days", 1000.0),
        ("Reasoning... #### 56", 56.0),
        ("I have 3 apples and 5 pears, total 8", 8.0),
        ("no numbers at all", None),
    ],
)
def test_parse_gsm8k_answer(completion, expected):
    assert parse_gsm8k_answer(completion) == expected


def test_gsm8k_reward_exact_values():
    completions = [
        "<reasoning>6 * 12 = 72</reasoning>\n<answer>\n72\n</answer>",
        "<answer>72.0</answer>",
        "<answer>73</answer>",
        "no answer",
        conversational("The answer is 72."),
        "<answer>72</answer>",
        "<answer>72</answer>",
    ]
    gold = ["72", "72", "72", "72", "72", None, "seventy-two"]
    assert gsm8k_reward(completions, answer=gold) == [1.0, 1.0, 0.0, 0.0, 1.0, None, None]
    assert gsm8k_reward(["<answer>1000</answer>"], answer=["1,000"]) == [1.0]
    assert gsm8k_reward(["<answer>1</answer>"]) == [None]


# ---------------------------------------------------------------------------------------------------------------
# Format


@pytest.mark.parametrize(
    "completion, strict, soft",
    [
        ("<reasoning>\nfirst\nsecond\n</reasoning>\n<answer>\n5\n</answer>", 1.0, 1.0),  # multi-line (d1 misses it)
        ("  <reasoning>a</reasoning><answer>5</answer>\n\n", 1.0, 1.0),
        ("<reasoning>a</reasoning>\n<answer>5</answer> trailing!!", 0.0, 0.99),  # 10 characters after </answer>
        ("<answer>5</answer>", 0.0, 0.5),
        ("<reasoning>a</reasoning>", 0.0, 0.5),
        ("<answer>5</answer><reasoning>a</reasoning>", 0.0, 0.976),  # wrong order: 24 characters after </answer>
        ("<reasoning>a</reasoning><answer>5</answer><answer>6</answer>", 0.0, 0.5),
        ("<reasoning>a<answer>5</answer></reasoning><answer>5</answer>", 0.0, 0.5),
        ("preamble <reasoning>a</reasoning><answer>5</answer>", 0.0, 1.0),
        ("plain text", 0.0, 0.0),
        ("<answer>5</answer>" + "x" * 2000, 0.0, 0.0),  # the penalty is clipped at 0
    ],
)
def test_format_rewards_exact_values(completion, strict, soft):
    for form in (completion, conversational(completion)):
        assert format_reward([form]) == [strict]
        assert soft_format_reward([form]) == [pytest.approx(soft)]


# ---------------------------------------------------------------------------------------------------------------
# Code

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


def answer_code(code):
    return f"<reasoning>easy</reasoning>\n<answer>\n```python\n{code}\n```\n</answer>"


def test_extract_code():
    assert extract_code(answer_code("x = 1")) == "x = 1\n"
    assert extract_code("```python\nfirst\n```\ntext\n```py\nsecond\n```") == "second\n"  # the last block
    assert extract_code("<answer>\ndef f(): return 1\n</answer>") == "def f(): return 1"  # no fence: the answer
    assert extract_code("no code here") is None


def test_code_reward_exact_values_in_one_batch():
    completions = [
        answer_code("def add(a, b):\n    return a + b"),  # all pass
        conversational(answer_code("def add(a, b):\n    return a + b")),
        answer_code("def add(a, b):\n    return a * b if a == b else a + b"),  # add(2, 2) = 4 either way: passes
        answer_code("def add(a, b):\n    return abs(a) + b"),  # fails add(-1, 1)
        answer_code("def add(a, b) return a + b"),  # syntax error
        "I cannot write code.",  # no code
        answer_code("def add(a, b):\n    raise SystemExit(0)"),  # exits in every test
        answer_code("print('0' * 32, 3)\ndef add(a, b):\n    return None"),  # cannot forge a result line
        answer_code("def add(a, b):\n    return a + b"),  # a row without tests
    ]
    tests = [TESTS] * 8 + [None]
    rewards = code_reward(completions, tests=tests, test_setup=[""] * 9, timeout_seconds=10, max_workers=2)
    assert rewards == [1.0, 1.0, 1.0, pytest.approx(2 / 3), 0.0, 0.0, 0.0, 0.0, None]
    assert code_solved(completions[:4], tests=[TESTS] * 4, timeout_seconds=10, max_workers=2) == [1.0, 1.0, 1.0, 0.0]
    assert code_reward(completions[:1]) == [None]


def test_code_reward_setup_runs_before_the_program():
    code = answer_code("def total(values: List[int]) -> int:\n    return sum(values)")
    assert code_reward([code], tests=[["assert total([1, 2]) == 3"]]) == [0.0]  # NameError: List
    assert code_reward([code], tests=[["assert total([1, 2]) == 3"]], test_setup=["from typing import List"]) == [1.0]


def test_code_infinite_loop_is_killed_at_the_time_limit():
    start = time.perf_counter()
    run = run_tests("def add(a, b):\n    while True:\n        pass", TESTS, timeout_seconds=1.0)
    elapsed = time.perf_counter() - start
    assert run.timed_out and run.passed == 0 and run.pass_rate == 0.0
    assert elapsed < 4.0  # 1 s limit plus process start-up on a loaded machine
    # A loop at import time, and a loop after two tests passed: the run as a whole scores 0.
    looping = [answer_code("while True:\n    pass"), answer_code("def add(a, b):\n    return a + b")]
    hanging_tests = [TESTS, TESTS[:2] + ["while True: pass"]]
    assert code_reward(looping, tests=hanging_tests, timeout_seconds=1.0, max_workers=2) == [0.0, 0.0]


def test_code_huge_memory_fails():
    programs = [
        "data = bytearray(2**40)\ndef add(a, b):\n    return a + b",  # 1 TiB at once
        "chunks = []\nwhile True:\n    chunks.append(bytearray(2**26))",  # grows until the limit
    ]
    rewards = code_reward([answer_code(p) for p in programs], tests=[TESTS] * 2, memory_limit_mb=512, max_workers=2)
    assert rewards == [0.0, 0.0]


def test_largest_digit_reward_is_an_exact_match():
    completions = ["8", " 8\n", "6", "8.0", "88", "<answer>8</answer>", [{"role": "assistant", "content": "8"}], "8"]
    answers = ["8"] * 7 + [None]
    assert largest_digit_reward(completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, None]
    assert largest_digit_reward(["8"]) == [None]
