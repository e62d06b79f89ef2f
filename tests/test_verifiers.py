"""common/verifiers.py: equivalent forms, garbage, and a pathological input under the time limit."""

import threading
import time

from common.verifiers import extract_answer, format_reward, last_boxed, math_rewards
from common.verifiers import testbed_reward as check_testbed


def test_testbed_checker_wants_exactly_the_answer():
    assert check_testbed("9", "9") == 1.0 and check_testbed(" 9\n", "9") == 1.0
    assert check_testbed("90", "9") == 0.0 and check_testbed("9 9", "9") == 0.0
    assert check_testbed("", "9") == 0.0


def test_answer_extraction_prefers_last_balanced_boxed_then_hashes():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"cut off \boxed{\frac{1}{2}") is None
    assert extract_answer("so #### 1,234") == "1234"
    assert extract_answer("no answer here") is None


def test_math_checker_accepts_equivalent_forms():
    preds = [r"\boxed{\frac{1}{2}}", r"\boxed{0.5}", r"\boxed{\dfrac{1}{2}}", "#### 1,000", r"\boxed{\sqrt{4}}",
             r"\boxed{x^2+2x+1}"]
    golds = ["0.5", r"\frac12", "1/2", "1000", "2", "(x+1)^2"]
    assert math_rewards(preds, golds) == [1.0] * len(preds)


def test_math_checker_rejects_wrong_and_garbage_without_raising():
    preds = [r"\boxed{3}", "", "no box", r"\boxed{", r"\boxed{\frac{", "\x00\x01 {{{}}}", r"\boxed{" + "(" * 5000 + "}"]
    assert math_rewards(preds, ["2"] * len(preds)) == [0.0] * len(preds)


def test_pathological_input_is_cut_off_by_the_time_limit_and_others_still_scored():
    # SymPy tries to evaluate this tower for minutes without the limit
    start = time.time()
    rewards = math_rewards([r"\boxed{9^{9^{9^{9}}}}", r"\boxed{\frac{2}{4}}"], ["1", "0.5"], timeout=2.0)
    assert rewards == [0.0, 1.0]
    assert time.time() - start < 15


def test_math_checker_is_thread_safe():
    out = {}

    def work(i):
        out[i] = math_rewards([rf"\boxed{{{i}/2}}", r"\boxed{7}"], [str(i / 2), "8"])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert all(out[i] == [1.0, 0.0] for i in range(4))


def test_format_reward():
    assert format_reward("19", "testbed") == 1.0
    assert format_reward("nineteen", "testbed") == 0.0
    assert format_reward(r"so \boxed{2}", "math") == 1.0 and format_reward("2", "math") == 0.0
