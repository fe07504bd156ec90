"""Math answer verification: extract the final answer, then compare it with the reference
*mathematically* (1/2 = 0.5 = \\frac{2}{4}, x=2 ~ 2, 10\\% ~ 10 per math-verify's rules).

Extraction: the content of the last `\\boxed{…}` / `\\fbox{…}` (brace-balanced, so nested
`\\frac{…}{…}` survive — a regex cannot do that), else a "final answer is …" / "Answer: …" /
"#### …" line, else nothing (a completion without a recognisable final answer scores 0).

Comparison: Hugging Face `math-verify` (LaTeX → sympy via latex2sympy2_extended, with its
normalisation of units, percentages, sets, intervals, equations). If math-verify is not installed
or cannot parse one side, a small sympy fallback parses plain/LaTeX-lite expressions and compares
them symbolically and numerically.

Time: sympy can take practically forever (`\\boxed{2^{2^{2^{40}}}}` ran for minutes), so one
deadline of `VERIFY_TIMEOUT_S` bounds the whole comparison, math-verify and fallback together; an
answer that cannot be checked in time counts as wrong (as math-verify's own timeouts do). The
deadline is of CPU time (a SIGPROF timer, ITIMER_PROF), not of the wall clock: on a loaded machine a
comparison that waits for a core would otherwise run out of time and count a right answer as wrong
(a signal error, not a lost sample); waiting is bounded by the runner's wall-clock timeout, whose
expiry is a reward error, not a wrong answer. A signal timer works in a main thread: that of a reward
worker process, where the runner calls sync rewards. math-verify's own timeouts stay off: they are
SIGALRM timers, one per parse and per comparison, and each cancels any other alarm when it ends
(ours is a different timer and signal, so neither cancels the other). Elsewhere (a thread of the
runner's in-process mode) there is no deadline and the runner's timeout applies; arithmetic stuck
in one C call (a huge integer power) defers the alarm until it returns, which is what the worker's
hard timeout (SIGKILL) is for.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
from contextlib import contextmanager
from typing import Any
from collections.abc import Iterator

from mcore_rl.rewards.base import RewardInput

logger = logging.getLogger(__name__)

VERIFY_TIMEOUT_S = (
    5.0  # CPU seconds for one comparison, math-verify and fallback together (math-verify's default per step)
)


class VerifyTimeout(BaseException):
    """The comparison ran past its deadline. A BaseException, so that the `except Exception` of
    math-verify and sympy do not swallow it and carry on without a deadline."""


@contextmanager
def deadline(seconds: float | None) -> Iterator[bool]:
    """Raise `VerifyTimeout` in this block once the process has used `seconds` of CPU time (a
    SIGPROF timer); yields whether a deadline is set: only in the main thread, where signal handlers
    run."""
    if seconds is None or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield False
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise VerifyTimeout(f"no verdict within {seconds:g}s of CPU time")

    previous = signal.signal(signal.SIGPROF, on_alarm)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


_BOX_COMMANDS = ("\\boxed", "\\fbox")
_FINAL_PATTERNS = [
    re.compile(r"final answer\s*(?:is|:)?\s*[:=]?\s*(.+)", re.IGNORECASE),
    re.compile(r"(?:^|\n)\s*\**answer\**\s*[:=]\s*(.+)", re.IGNORECASE),
    re.compile(r"(?:^|\n)\s*####\s*(.+)"),
]


def _brace_group(text: str, start: int) -> tuple[str, int] | None:
    """The content of the {...} group opening at `start` and the index after it; escaped braces
    (\\{ \\}) do not count. None if `start` is not '{' or the group never closes."""
    if start >= len(text) or text[start] != "{":
        return None
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last complete \\boxed{…} or \\fbox{…} (also `\\boxed 5`), else None."""
    best: tuple[int, str] | None = None
    for cmd in _BOX_COMMANDS:
        pos = text.rfind(cmd)
        while pos != -1:
            after = pos + len(cmd)
            j = after
            while j < len(text) and text[j] == " ":
                j += 1
            content: str | None = None
            if j < len(text) and text[j] == "{":
                group = _brace_group(text, j)
                content = group[0] if group else None
            elif j > after:  # "\boxed 5": up to whitespace or '$'
                m = re.match(r"[^\s$]+", text[j:])
                content = m.group(0) if m else None
            if content is not None:
                if best is None or pos > best[0]:
                    best = (pos, content)
                break
            pos = text.rfind(cmd, 0, pos)
    return best[1].strip() if best else None


def _clean_line(ans: str) -> str:
    ans = ans.strip().splitlines()[0].strip() if ans.strip() else ""
    ans = ans.strip("*").strip()
    if len(ans) >= 2 and ans[0] == "$" and ans.rstrip(".")[-1:] == "$":
        ans = ans.rstrip(".").strip("$")
    return ans.rstrip(".").strip()


def extract_answer(text: str) -> str | None:
    """The completion's final answer as a string, or None if it states none."""
    boxed = last_boxed(text)
    if boxed:
        return boxed
    for pattern in _FINAL_PATTERNS:
        matches = list(pattern.finditer(text))
        if matches:
            ans = _clean_line(matches[-1].group(1))
            inner = last_boxed(ans)
            return inner or ans or None
    return None


# ------------------------------------------------------------------------- math-verify


def _math_verify_equal(pred: str, gold: str) -> bool | None:
    """math-verify's verdict, or None if it is unavailable or could not parse either side."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    try:
        gold_p = parse("\\boxed{" + gold + "}", parsing_timeout=None)
        pred_p = parse("\\boxed{" + pred + "}", parsing_timeout=None)
        if not gold_p or not pred_p:
            return None
        return bool(verify(gold_p, pred_p, timeout_seconds=None))
    except Exception as exc:
        logger.debug("math-verify failed on %r vs %r: %s", pred, gold, exc)
        return None


# ------------------------------------------------------------------------- sympy fallback

_LATEX_SUBS = [
    (r"\\left|\\right|\\!|\\,|\\;|\\:|\\quad|\\displaystyle", ""),
    (r"\\[dt]frac", r"\\frac"),
    (r"\^\{?\\circ\}?|°", ""),
    (r"\\%|%", ""),
    (r"\\cdot|\\times", "*"),
    (r"\\pi", "pi"),
    (r"\\infty", "oo"),
    (r"\\ln", "log"),
]


def _replace_command(s: str, cmd: str, arity: int, template: str) -> str:
    """Rewrite `\\cmd{a}{b}` (brace-balanced) with `template.format(a, b)`; `\\frac12` too."""
    out, i = [], 0
    while True:
        j = s.find(cmd, i)
        if j == -1:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i:j])
        k = j + len(cmd)
        args = []
        for _ in range(arity):
            while k < len(s) and s[k] == " ":
                k += 1
            group = _brace_group(s, k)
            if group:
                args.append(group[0])
                k = group[1]
            elif k < len(s):
                args.append(s[k])
                k += 1
        args += [""] * (arity - len(args))
        out.append(
            template.format(
                *[
                    _replace_command(_replace_command(a, "\\frac", 2, "(({})/({}))"), "\\sqrt", 1, "sqrt({})")
                    for a in args
                ]
            )
        )
        i = k


def latex_to_sympy_text(s: str) -> str:
    """LaTeX-lite → a string sympy's parser reads (fractions, roots, \\cdot, ^, \\pi, %)."""
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^{}]*)\}|\\mathrm\{([^{}]*)\}", lambda m: m.group(1) or m.group(2) or "", s)
    for pat, rep in _LATEX_SUBS:
        s = re.sub(pat, rep, s)
    if "=" in s:  # "x = 5" -> "5"
        s = s.split("=")[-1]
    s = _replace_command(s, "\\frac", 2, "(({})/({}))")
    s = _replace_command(s, "\\sqrt", 1, "sqrt({})")
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    s = s.replace("\\", "")
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # 1,000 -> 1000
    return s.strip()


def sympy_equal(pred: str, gold: str, rel_tol: float = 1e-6) -> bool:
    """Symbolic (simplify(a - b) == 0) or numeric equality of two LaTeX-lite expressions."""
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    a_txt, b_txt = latex_to_sympy_text(pred), latex_to_sympy_text(gold)
    if a_txt == b_txt:
        return bool(a_txt)
    transforms = standard_transformations + (implicit_multiplication_application, convert_xor)
    try:
        a = parse_expr(a_txt, transformations=transforms, evaluate=True)
        b = parse_expr(b_txt, transformations=transforms, evaluate=True)
    except Exception:
        return False
    try:
        if sympy.simplify(a - b) == 0:
            return True
        av, bv = complex(sympy.N(a)), complex(sympy.N(b))
        return abs(av - bv) <= rel_tol * max(1.0, abs(bv))
    except Exception:
        return False


def math_equal(pred: str, gold: Any, timeout_s: float | None = VERIFY_TIMEOUT_S) -> bool:
    """Is the extracted answer `pred` the reference `gold` (a string or a number)? False also when
    no verdict comes within `timeout_s` (main thread only; see the module docstring)."""
    gold_s = str(gold).strip()
    pred_s = pred.strip()
    if not pred_s or not gold_s:
        return False
    try:
        with deadline(timeout_s):
            verdict = _math_verify_equal(pred_s, gold_s)
            return verdict if verdict is not None else sympy_equal(pred_s, gold_s)
    except VerifyTimeout as exc:
        logger.warning("math verifier: %s on %.80r vs %.80r; counted as wrong", exc, pred_s, gold_s)
        return False


def math_reward(sample: RewardInput) -> float:
    """1.0 if the completion's final answer equals `sample.label`, else 0.0 (also when no final
    answer can be found). A missing label is a data error and raises."""
    if sample.label is None:
        raise ValueError("math_reward needs the reference answer in RewardInput.label")
    answer = extract_answer(sample.completion)
    if answer is None:
        return 0.0
    return 1.0 if math_equal(answer, sample.label) else 0.0
