"""Rewards for verifiable answers: answer extraction, math equivalence, over-long shaping.

- Extraction: the answer a reply gives, by `\\boxed{...}` (the last one, nested braces
  balanced), `#### ANSWER` (GSM8K's form) or the last number of the text, tried in a given order.
- Equivalence (`answers_match`): a built-in comparison of normalized answers, where numbers are
  compared exactly as rationals (0.5 = 1/2 = \\frac{1}{2} = 0.50) after `$`, `%`, thousands
  separators, `\\text{}` and trailing unit words are stripped, and other answers as text
  (whitespace and case ignored). With the `math` extra installed (the `math-verify` package), the
  "math_verify" verifier also accepts what math-verify proves equal (\\sqrt{2} = 2/\\sqrt{2},
  intervals, expressions) where the built-in comparison says no.
- Over-long shaping (DAPO's soft over-long punishment): `overlong_penalty`, applied by the
  Rollouter when `rollout.overlong_buffer_tokens` is set.
"""

from __future__ import annotations

import importlib.util
import re
import threading
from collections.abc import Sequence
from fractions import Fraction

from rlactors.config import ConfigError

EXTRACTORS = ("boxed", "hash", "last_number")
VERIFIERS = ("auto", "builtin", "math_verify")
OVERLONG = "overlong"  # the reward component of the over-long penalty
# math-verify bounds each parse and comparison with signal.alarm, in whole seconds (main thread only).
MATH_VERIFY_TIMEOUT_S = 5

# ---------------------------------------------------------------------------------------------
# Extraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A number not glued to a word or another number: -12, 1,234.5, 3/4. A thousands separator needs
# groups of exactly three digits, so a list "1,2,3" ends in the number 3.
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?![\d,])|\d+)(?:\.\d+)?(?:/\d+)?")


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) whose braces close; None without one."""
    for match in reversed(list(_BOXED.finditer(text))):
        content = _braced(text, match.end())
        if content is not None:
            return content.strip()
    return None


def extract_hash(text: str) -> str | None:
    """The rest of the line after the last `####` (GSM8K's answer line); None without one."""
    at = text.rfind("####")
    if at < 0:
        return None
    line = text[at + 4:].strip().split("\n", 1)[0].strip()
    return line or None


def extract_last_number(text: str) -> str | None:
    """The last number of the text (`-12`, `1,234.5`, `3/4`); None without one."""
    numbers = _NUMBER.findall(text.replace("\u2212", "-"))
    return numbers[-1] if numbers else None


_EXTRACT = {"boxed": extract_boxed, "hash": extract_hash, "last_number": extract_last_number}


def extract_answer(text: str, order: Sequence[str] = EXTRACTORS) -> str | None:
    """The answer found by the first method of `order` (names from EXTRACTORS) that finds one."""
    for name in order:
        answer = _EXTRACT[name](text)
        if answer is not None:
            return answer
    return None


def reference_answer(text: str) -> str | None:
    """The final answer of a dataset's answer field: after `####` (GSM8K's worked solutions), else
    inside the last `\\boxed{}` (MATH's), else the whole text. None when a marked answer is empty."""
    if "####" in text:
        return extract_hash(text)
    if _BOXED.search(text):
        return extract_boxed(text)
    return text.strip() or None


def _braced(text: str, start: int) -> str | None:
    """The text from `start` (just after an opening brace) to its closing brace, or None."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


# ---------------------------------------------------------------------------------------------
# Equivalence

_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_DROPPED = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\$", "$", "\\%", "%",
            "^{\\circ}", "^\\circ", "\u00b0")
_ASSIGNMENT = re.compile(r"^[a-zA-Z]\s*=\s*")  # "x = 5" answers 5
_PLAIN_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_UNIT = re.compile(r"^(\S+?)\s*[a-zA-Z][a-zA-Z ]*\.?$")  # "12 apples", "5 dollars", "3cm"
_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$|^(-?)\\frac(\d)(\d)$")


def normalize_answer(answer: str) -> str:
    """The answer with its decorations removed: an enclosing `\\boxed{}`, `$`, `%`, degrees, spacing
    commands, `\\text{}` wrappers (their content is kept), `x =`, trailing unit words and a final
    period; `\\dfrac` and `\\tfrac` become `\\frac`."""
    s = answer.strip()
    boxed = extract_boxed(s)
    if boxed is not None and s.startswith(("\\boxed", "\\fbox")):
        s = boxed
    s = _TEXT_WRAPPERS.sub(r"\1", s)
    for token in _DROPPED:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\u2212", "-")
    s = _ASSIGNMENT.sub("", s.strip()).rstrip(".").strip()
    unit = _UNIT.match(s)
    if unit and parse_number(unit.group(1)) is not None:
        s = unit.group(1)
    return s


def parse_number(text: str) -> Fraction | None:
    """The exact value of a plain number (`-1,234.50`, `.5`), a ratio (`3/4`) or a `\\frac{a}{b}`
    of integers, else None."""
    s = text.replace(" ", "")
    if _PLAIN_NUMBER.fullmatch(s):
        return Fraction(s.replace(",", ""))
    num, _, den = s.partition("/")
    if den and _PLAIN_NUMBER.fullmatch(num) and _PLAIN_NUMBER.fullmatch(den):
        return _ratio(num, den)
    frac = _FRAC.match(s)
    if frac:
        sign, a, b = (frac.group(1), frac.group(2), frac.group(3)) if frac.group(2) else frac.group(4, 5, 6)
        value = _ratio(a, b)
        return -value if sign and value is not None else value
    return None


def _ratio(num: str, den: str) -> Fraction | None:
    d = Fraction(den.replace(",", ""))
    return Fraction(num.replace(",", "")) / d if d else None


def builtin_match(predicted: str, reference: str) -> bool:
    """Equal as numbers when both are numbers, else as normalized text (whitespace and case ignored)."""
    p, r = normalize_answer(predicted), normalize_answer(reference)
    p_value, r_value = parse_number(p), parse_number(r)
    if p_value is not None and r_value is not None:
        return p_value == r_value
    canonical_p, canonical_r = ("".join(x.lower().split()) for x in (p, r))
    return bool(canonical_p) and canonical_p == canonical_r


def math_verify_installed() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def resolve_verifier(name: str, key: str) -> str:
    """"builtin" or "math_verify" for the verifier `name` ("auto": math_verify when installed)."""
    if name not in VERIFIERS:
        raise ConfigError(f"{key}: expected one of {', '.join(map(repr, VERIFIERS))}, got {name!r}")
    if name == "auto":
        return "math_verify" if math_verify_installed() else "builtin"
    if name == "math_verify" and not math_verify_installed():
        raise ConfigError(f"{key}: 'math_verify' needs the math-verify package: "
                          "pip install 'rlactors[math]' (or pip install math-verify)")
    return name


def math_verify_match(predicted: str, reference: str) -> bool:
    """math-verify's verdict on the two normalized answers, each read as LaTeX math.

    Its timeouts use signal.alarm, which only the main thread may set; elsewhere it runs
    without them.
    """
    from math_verify import parse, verify

    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"${normalize_answer(reference)}$", parsing_timeout=timeout)
    answer = parse(f"${normalize_answer(predicted)}$", parsing_timeout=timeout)
    return bool(gold) and bool(answer) and bool(verify(gold, answer, timeout_seconds=timeout))


def answers_match(predicted: str, reference: str, verifier: str = "builtin") -> bool:
    """Whether `predicted` is the `reference` answer. `verifier`: "builtin", or "math_verify"
    (the built-in comparison, then math-verify's where it says no)."""
    if builtin_match(predicted, reference):
        return True
    return verifier == "math_verify" and math_verify_match(predicted, reference)


# ---------------------------------------------------------------------------------------------
# Over-long shaping


def overlong_penalty(turn_lengths: Sequence[int], max_tokens: int, buffer_tokens: int, penalty: float) -> float:
    """DAPO's soft over-long punishment of a rollout, from its longest completion (in tokens).

    0 up to `max_tokens - buffer_tokens` tokens, then falling linearly to `-penalty` at
    `max_tokens` (the per-turn limit, where a completion is cut).
    """
    if not 1 <= buffer_tokens <= max_tokens:
        raise ValueError(f"buffer_tokens must be in [1, max_tokens={max_tokens}], got {buffer_tokens}")
    excess = max(turn_lengths, default=0) - (max_tokens - buffer_tokens)
    if excess <= 0:
        return 0.0
    return -penalty * min(excess, buffer_tokens) / buffer_tokens
