"""rlactors.rollout.rewards: answer extraction, the built-in and math-verify equivalence, the over-long penalty."""

import threading
from fractions import Fraction

import pytest

from rlactors.config import ConfigError
from rlactors.rollout.rewards import (
    answers_match,
    builtin_match,
    extract_answer,
    extract_boxed,
    extract_hash,
    extract_last_number,
    math_verify_installed,
    normalize_answer,
    overlong_penalty,
    parse_number,
    reference_answer,
    resolve_verifier,
)

needs_math_verify = pytest.mark.skipif(not math_verify_installed(), reason="math-verify is not installed")


def test_boxed_takes_the_last_box_whose_braces_close():
    assert extract_boxed(r"so \boxed{\frac{1}{\sqrt{2}}} is it") == r"\frac{1}{\sqrt{2}}"
    assert extract_boxed(r"\boxed{3} no, \boxed{ 4 }") == "4"
    assert extract_boxed(r"\boxed{5} and then \boxed{6") == "5"  # the last one never closes
    assert extract_boxed(r"\fbox{7}") == "7"
    assert extract_boxed(r"\boxed {x^{2}}") == "x^{2}"
    assert extract_boxed("the answer is 5") is None


def test_hash_takes_the_rest_of_the_line_after_the_last_marker():
    assert extract_hash("She has 3 + 4 = 7.\n#### 7") == "7"
    assert extract_hash("#### 1,234 dollars\nthanks") == "1,234 dollars"
    assert extract_hash("#### 1\n#### 2") == "2"
    assert extract_hash("####\n") is None and extract_hash("no marker") is None


def test_last_number_reads_signs_separators_decimals_and_ratios():
    assert extract_last_number("12 apples, then -7, so 1,234,567.") == "1,234,567"
    assert extract_last_number("It costs $18.50.") == "18.50"
    assert extract_last_number("a ratio of 3/4") == "3/4"
    assert extract_last_number("pages 3-4") == "4"  # a hyphen between numbers is no minus sign
    assert extract_last_number("the list 1,2,3") == "3"  # not a thousands separator
    assert extract_last_number("x2 is a name") is None  # digits glued to a word are not a number
    assert extract_last_number("minus \u22125") == "-5"


def test_extraction_order_decides_which_answer_counts():
    text = "I think 41.\n#### 42\nFinal: \\boxed{43}"
    assert extract_answer(text) == "43"
    assert extract_answer(text, ["hash", "boxed"]) == "42"
    assert extract_answer("I think 41.", ["boxed", "hash"]) is None
    assert extract_answer("I think 41.", ["boxed", "hash", "last_number"]) == "41"


def test_reference_answers_of_gsm8k_and_math_solutions():
    assert reference_answer("Natalia sold 48/2 = 24 clips in May.\n#### 72") == "72"
    assert reference_answer(r"So the total is $\boxed{\frac{3}{4}}$.") == r"\frac{3}{4}"
    assert reference_answer("  18 ") == "18"
    assert reference_answer("worked out\n#### ") is None


@pytest.mark.parametrize("predicted, reference", [
    ("0.5", "1/2"), (r"\frac{1}{2}", "0.5"), (r"\dfrac{1}{2}", "1/2"), (r"\frac12", ".5"),
    (r"-\frac{1}{2}", "-0.5"), (r"\frac{-1}{2}", "-1/2"), (r"\boxed{\frac{3}{4}}", "0.75"),
    ("1,000", "1000"), ("1000", "1,000"), (r"1\,000", "1000"), ("18.00", "18"), ("72.", "72"),
    ("5 dollars", "5"), ("$5", "5"), (r"\$5", "5"), (r"5\text{ cm}", "5"), ("12 apples", "12"),
    ("1,000 apples", "1000"), ("50%", "50"), (r"50\%", "50"), (r"90^\circ", "90"), ("x = 5", "5"),
    ("-3", "-3"), ("\u22123", "-3"), (r"\text{(C)}", "(c)"), ("x^2 + 1", "x^2+1"),
])
def test_equivalent_forms_match(predicted, reference):
    assert builtin_match(predicted, reference)
    assert answers_match(predicted, reference, "builtin")


@pytest.mark.parametrize("predicted, reference", [
    ("41", "42"), ("-3", "3"), ("3", "-3"), ("0.33", "1/3"), ("1,2", "12"), ("1/2", "2"),
    (r"\frac{1}{2}", r"\frac{2}{1}"), ("", "5"), ("   ", "5"), ("5 dollars", "6"), ("(A)", "(C)"),
    ("1/0", "0"),
])
def test_different_answers_do_not_match(predicted, reference):
    assert not builtin_match(predicted, reference)
    assert not answers_match(predicted, reference, "builtin")


def test_numbers_are_exact_rationals():
    assert parse_number("-1,234.50") == Fraction(-2469, 2)
    assert parse_number(r"\frac{6}{4}") == Fraction(3, 2)
    assert parse_number("3 / 4") == Fraction(3, 4)
    assert parse_number("1/0") is None and parse_number("abc") is None and parse_number("1,23") is None
    assert normalize_answer(r"\boxed{x = \dfrac{1}{2}}") == r"\frac{1}{2}"


@needs_math_verify
@pytest.mark.parametrize("predicted, reference", [
    (r"\frac{2}{\sqrt{2}}", r"\sqrt{2}"), ("1 + x", "x+1"), (r"2^{10}", "1024"), (r"\frac{1}{3}", "0.3333333"),
])
def test_math_verify_adds_symbolic_equivalence(predicted, reference):
    assert not builtin_match(predicted, reference)
    assert answers_match(predicted, reference, "math_verify")


@needs_math_verify
@pytest.mark.parametrize("predicted, reference", [
    ("41", "42"), ("-3", "3"), (r"\sqrt{3}", r"\sqrt{2}"), ("Eli Price", "3"), ("", "5"), ("(1, 3)", "(1,2)"),
])
def test_math_verify_still_rejects_wrong_answers(predicted, reference):
    assert not answers_match(predicted, reference, "math_verify")


def test_verifier_choice():
    assert resolve_verifier("builtin", "k") == "builtin"
    assert resolve_verifier("auto", "k") == ("math_verify" if math_verify_installed() else "builtin")
    with pytest.raises(ConfigError, match="^k: expected one of"):
        resolve_verifier("sympy", "k")


def test_asking_for_math_verify_without_it_names_the_extra(monkeypatch):
    monkeypatch.setattr("rlactors.rollout.rewards.math_verify_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"^env.args.verifier: 'math_verify' needs the math-verify package: "
                                          r"pip install 'rlactors\[math\]'"):
        resolve_verifier("math_verify", "env.args.verifier")
    assert resolve_verifier("auto", "env.args.verifier") == "builtin"


def test_overlong_penalty_is_zero_then_linear_to_the_limit():
    # max 64 tokens, the last 16 penalized: 48 -> 0, 56 -> half, 64 -> all.
    assert overlong_penalty([10], 64, 16, 1.0) == 0.0
    assert overlong_penalty([48], 64, 16, 1.0) == 0.0
    assert overlong_penalty([52], 64, 16, 1.0) == -0.25
    assert overlong_penalty([56], 64, 16, 2.0) == -1.0
    assert overlong_penalty([64], 64, 16, 1.0) == -1.0
    assert overlong_penalty([10, 60, 20], 64, 16, 1.0) == -0.75  # the longest turn counts
    assert overlong_penalty([], 64, 16, 1.0) == 0.0
    assert overlong_penalty([64], 64, 64, 1.0) == -1.0
    with pytest.raises(ValueError, match="buffer_tokens"):
        overlong_penalty([10], 64, 0, 1.0)


@needs_math_verify
def test_math_verify_runs_off_the_main_thread_without_its_signal_timeout():
    results = []
    worker = threading.Thread(target=lambda: results.append(answers_match(r"\frac{2}{\sqrt{2}}", r"\sqrt{2}",
                                                                          "math_verify")))
    worker.start()
    worker.join()
    assert results == [True]
