"""Grading a math completion against a reference answer, the way MATH-style RL runs grade.

Three steps, cheapest first:

1. **Extract** the content of the completion's last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`),
   braces matched. Only the last box counts: a model that boxes a guess early and then revises is graded on
   the revision, and a box cut off before it closes (a truncated answer) is no answer at all. No box: 0.
2. **Normalise** both sides (the Hendrycks MATH `strip_string` rules plus a few more): spaces, `\\left` /
   `\\right`, `\\dfrac` / `\\tfrac` -> `\\frac`, `\\frac12` -> `\\frac{1}{2}`, `\\sqrt2` -> `\\sqrt{2}`,
   `\\text{}` wrappers, trailing units (`5\\text{ cm}`, `5 cm`), degrees, `\\%`, `\\$`, trailing
   punctuation, thousands separators, a leading `x =`, `(C)` -> `C`. Equal strings match; two plain
   numbers (integers, decimals, `a/b`, `\\frac{a}{b}`) match when they are the same rational number,
   exactly: `0.5` is `\\frac{1}{2}`, `0.33` is not `\\frac{1}{3}`.
3. **Fall back** to math-verify (sympy) for forms the rules do not cover (`\\frac{\\sqrt{2}}{2}` vs
   `\\sqrt{2}/2`, `(x+1)^2` vs `x^2+2x+1`, sets in any order). It is slow and can raise or hang on
   pathological input, so it runs only when step 2 is inconclusive, never on two plain numbers (already
   decided), never on long or tower-exponent input, with its own timeouts in the main thread (they use
   SIGALRM, which works nowhere else; TRL scores in a worker thread), and any exception is "not equal".

Pure Python: no torch, Ray, vLLM or HTTP; math-verify is imported on first fallback.
"""

from __future__ import annotations

import functools
import re
import threading
from fractions import Fraction

_BOX = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
# Inputs longer than this, or with exponent towers / huge exponents / big factorials, skip math-verify:
# sympy may take minutes on them, and in a worker thread nothing can interrupt it.
_FALLBACK_MAX_CHARS = 200
# What math-verify would evaluate for minutes (it simplifies with sympy, which expands numbers): an exponent
# with an exponent inside (2^{3^{4}}), a tower written flat (9^9^9, 9^{9}^{9}), a factorial of a power
# (10^{10}!), a 5-digit exponent, a factorial of a 4-digit number.
_POWER = r"\^\s*(?:\{[^{}]*\}|\w+)\s*"
_RISKY = re.compile(rf"\^\s*\{{[^{{}}]*\^|{_POWER}\^|{_POWER}!|\^\s*\{{?\s*\d{{5,}}|\d{{4,}}\s*!")
_FALLBACK_TIMEOUT_S = 5

# Trailing words dropped after a number (`12 inches` -> `12`); `\text{...}` units are dropped whatever
# the word, so this list only needs the ones written bare.
_UNITS = (
    "units?|square units|sq units|cm|centimeters?|mm|millimeters?|km|kilometers?|m|meters?|inch(?:es)?|"
    "in|feet|foot|ft|yards?|miles?|mph|seconds?|minutes?|hours?|days?|weeks?|months?|years?|degrees?|"
    "dollars?|cents?|pounds?|lbs?|ounces?|oz|gallons?|liters?|grams?|kg|kilograms?|people|students|ways"
)
_TRAILING_UNIT_WORD = re.compile(rf"(?<=[\d}}])\s+(?:{_UNITS})(?:\^\{{?\d\}}?)?\s*\.?\s*$")
# `5\text{ cm}`, `\frac{1}{2}\mbox{ hour}`, `12\text{ cm}^2`: a text that follows a number is a unit.
_TRAILING_TEXT_UNIT = re.compile(
    r"(?<=[\d})])\s*\\(?:text|textrm|mbox|mathrm)\{\s*[a-zA-Z][a-zA-Z .]*\}(?:\^\{?\d\}?)?\s*$"
)
_TEXT_WRAPPER = re.compile(
    r"\\(?:text|textrm|textbf|textit|mbox|mathrm|mathbf|mathit|operatorname)\{([^{}]*)\}"
)
_LEADING_VARIABLE = re.compile(r"^(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?[a-zA-Z0-9]+\}?)?=")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_NUMBER = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)$")
_SLASH_FRACTION = re.compile(r"^([-+]?\d+)/(\d+)$")
_LATEX_FRACTION = re.compile(r"^([-+]?)\\frac\{([-+]?\d+)\}\{([-+]?\d+)\}$")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` / `\\fbox{...}` / `\\boxed 5` in `text`, braces matched
    (escaped `\\{` `\\}` do not count); None when there is none or the last one never closes.

    >>> last_boxed(r"so $x = \\boxed{\\frac{1}{2}}$, or \\boxed{\\{1, 2\\}}.")
    '\\\\{1, 2\\\\}'
    >>> last_boxed(r"\\boxed 5$."), last_boxed(r"\\boxed{3} then \\boxed{4"), last_boxed("5")
    ('5', None, None)
    """
    matches = list(_BOX.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        bare = re.match(r"[^\s$]+", text[i:])  # `\boxed 5` ends at a space or the closing `$`
        return bare.group(0) if bare else None
    depth, start = 0, i + 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # an escaped character (`\{`, `\}`, `\\`) never opens or closes
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def _unwrap_outer_braces(s: str) -> str:
    while s.startswith("{") and s.endswith("}"):
        depth = 0
        for i, ch in enumerate(s):
            depth += ch == "{"
            depth -= ch == "}"
            if depth == 0 and i < len(s) - 1:
                return s  # `{a}+{b}`: the first brace closes before the end
        s = s[1:-1]
    return s


def normalize(answer: str) -> str:
    """A canonical spelling of a final answer, for string comparison (see the module docstring).

    >>> normalize(r" \\left( \\dfrac12, 3 \\right) "), normalize(r"x = 1{,}000\\text{ cm}^2."), normalize(r"\\text{(C)}")
    ('(\\\\frac{1}{2},3)', '1000', 'C')
    """
    s = str(answer).strip()
    inner = last_boxed(s)  # a reference given as a whole solution, or a doubly boxed answer
    if inner is not None:
        s = inner
    s = s.replace("\n", " ").replace("\u2212", "-").replace("{,}", ",")
    s = re.sub(r"\\(?:displaystyle|textstyle|scriptstyle)(?![a-zA-Z])", "", s)
    s = re.sub(r"\\(?:left|right|[Bb]igg?[lr]?)(?![a-zA-Z])\s*\.?", "", s)  # `\left.` is an invisible brace
    s = re.sub(r"\\[dtc]frac(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\degree(?![a-zA-Z])", "", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"\\[,;:! ]|~|\\q?quad(?![a-zA-Z])", " ", s)  # spacing commands
    for pattern in (_TRAILING_TEXT_UNIT, _TRAILING_UNIT_WORD):
        s = pattern.sub("", s.strip().rstrip(".,;").rstrip())
    previous = None
    while previous != s:  # nested wrappers: \text{\textbf{A}}
        previous, s = s, _TEXT_WRAPPER.sub(r"\1", s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".,;")
    s = _unwrap_outer_braces(s)
    # One-character arguments without braces, as LaTeX reads them: \frac12, \frac{1}2, \sqrt3.
    s = re.sub(r"\\frac([^{\\])([^{\\])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}([^{\\])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac([^{\\])\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\sqrt([^{\[\\])", r"\\sqrt{\1}", s)
    s = re.sub(r"([\^_])\{(\w)\}", r"\1\2", s)  # x^{2} -> x^2
    if s.count("=") == 1 and _LEADING_VARIABLE.match(s):
        s = s.split("=", 1)[1]
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = re.sub(r"^\(([A-E])\)$", r"\1", s)  # a multiple-choice letter: (C) is C
    return s


def as_number(normalized: str) -> Fraction | None:
    """The exact rational value of a normalised plain number (`-3`, `0.25`, `.5`, `3/4`,
    `\\frac{3}{4}`, `-\\frac{3}{4}`), else None.

    >>> as_number("0.5") == as_number(r"\\frac{1}{2}") == as_number("1/2"), as_number("x")
    (True, None)
    """
    s = normalized
    if _NUMBER.match(s):
        return Fraction(s.rstrip(".") or "0")
    if m := _SLASH_FRACTION.match(s):
        return Fraction(int(m.group(1)), int(m.group(2))) if int(m.group(2)) else None
    if m := _LATEX_FRACTION.match(s):
        numerator, denominator = int(m.group(2)), int(m.group(3))
        if not denominator:
            return None
        value = Fraction(numerator, denominator)
        return -value if m.group(1) == "-" else value
    return None


@functools.lru_cache(maxsize=8192)  # a GRPO group's samples often repeat one answer: verify it once
def _math_verify_equal(predicted: str, reference: str) -> bool:
    if (
        max(len(predicted), len(reference)) > _FALLBACK_MAX_CHARS
        or _RISKY.search(predicted)
        or _RISKY.search(reference)
    ):
        return False
    try:
        from math_verify import parse, verify

        # SIGALRM-based timeouts exist only in the main thread; elsewhere they would raise.
        timeout = _FALLBACK_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
        gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=timeout)
        target = parse(f"\\boxed{{{predicted}}}", parsing_timeout=timeout)
        return bool(gold and target and verify(gold, target, timeout_seconds=timeout))
    except Exception:  # a parser or sympy failure, a timeout: not shown equal
        return False


def answers_match(predicted: str, reference: str) -> bool:
    """Whether an extracted answer equals the reference: normalised strings, exact rational values, then
    math-verify.

    >>> answers_match("0.5", r"\\dfrac{1}{2}"), answers_match(r"\\frac{\\sqrt{2}}{2}", r"\\sqrt2/2"), answers_match("0.33", r"\\frac13")
    (True, True, False)
    """
    p, r = normalize(predicted), normalize(reference)
    if not p or not r:
        return False
    if p == r:
        return True
    p_value, r_value = as_number(p), as_number(r)
    if p_value is not None and r_value is not None:
        return p_value == r_value  # two plain numbers: decided, math-verify would only add float slack
    return _math_verify_equal(predicted.strip(), (last_boxed(reference) or reference).strip())


def grade(text: str, reference: str) -> bool:
    """Whether `text` (a completion) ends with a boxed answer equal to `reference` (a final answer, or a
    whole solution whose last box is the answer).

    >>> grade(r"... so the area is $\\boxed{12\\text{ cm}^2}$.", "12"), grade("the answer is 12", "12")
    (True, False)
    """
    predicted = last_boxed(text)
    return predicted is not None and answers_match(predicted, str(reference))
