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


# (gold, boxed prediction, reward): commas separate the elements of tuples, intervals and lists, and only
# digit groups of three are a thousands separator
COMMA_CASES = [
    ("(1,2)", "(1, 2)", 1.0), ("(1,2)", "(12)", 0.0), ("(-1,2)", "(-12)", 0.0),  # tuples
    ("[1,3)", "[1, 3)", 1.0), ("[1,3)", "[13)", 0.0), ("[1,3)", "(1,3]", 0.0),  # intervals
    ("1,2", "12", 0.0), ("1, 2, 3", "1,2,3", 1.0), ("1,2,3", "123", 0.0),  # lists
    ("1234567", "1,234,567", 1.0), ("1,234", "1234", 1.0), ("12345.5", "12,345.5", 1.0),  # thousands separators
    ("1,234", "1,23,4", 0.0), ("123", "1,23", 0.0),
    ("-5", "-5", 1.0), ("-5", "5", 0.0), ("-1,234", "-1234", 1.0), ("-1,234", "-12,34", 0.0),  # negative numbers
    (r"\frac{\pi}{2}", r"\dfrac{\pi}{2}", 1.0), (r"\frac{1}{2},3", r"\frac{1}{2}3", 0.0),  # LaTeX-only answers
    ("1234", r"1\,234", 1.0), ("1234", "1{,}234", 1.0), (r"\sqrt{2}", r"\sqrt2", 1.0),
]


def test_commas_separate_elements_and_only_digit_triples_are_thousands():
    golds = [g for g, _, _ in COMMA_CASES]
    preds = [rf"so \boxed{{{p}}}" for _, p, _ in COMMA_CASES]
    got = dict(zip(COMMA_CASES, math_rewards(preds, golds)))
    assert got == {case: case[2] for case in COMMA_CASES}


def test_hashes_answer_keeps_list_commas_and_drops_thousands_separators():
    assert extract_answer("#### 1,234,567.") == "1234567"
    assert extract_answer("#### 1,2") == "1,2"
    assert math_rewards(["#### 1,2", "#### 12"], ["12", "1,2"]) == [0.0, 0.0]


def test_nl_answer_rule_boxed_then_answer_is_then_last_number():
    from common.problem import Problem
    from common.verifiers import score

    replies = {
        "7 + 5 = 12, so 40 + 30 + 12 = 82. The answer is 82.": 1.0,
        "The answer is **82** apples.": 1.0,
        "The answer is: $82$": 1.0,
        "Tom has 47 + 35 = 82 apples.": 1.0,  # no answer line: the last number
        "I think \\boxed{82}, the answer is 81.": 1.0,  # a boxed answer wins over the rest
        "The answer is 81. Wait, 47 + 35 = 82.": 0.0,  # the answer line wins over a later number
        "So \\boxed{\\frac{164}{2}}.": 1.0,  # an equal value, checked by math-verify
        "First 47 + 35 = 82. The answer is": 0.0,  # cut right before the number
        "47 + 35 = \\boxed{8": 0.0,  # a cut-off box
        "To add 47 and 35 we need to find a common multiple of 47 and": 0.0,  # truncated garbage
        "": 0.0, "\\boxed{}": 0.0, "answer is answer is": 0.0, "}{\\boxed{{{": 0.0, "1" * 5000: 0.0,
    }
    problems = [Problem(question="What is 47 + 35?", answer="82", task="nl")] * len(replies)
    assert score(list(replies), problems, timeout=60) == list(replies.values())  # a cold worker pool starts slowly
    assert extract_answer("The answer is 1,234.") == None and extract_answer("The answer is 1,234.", "nl") == "1234"


def test_nl_format_reward_wants_the_reply_to_end_with_the_answer_line():
    good = ["40 + 30 = 70. The answer is 82.", "The answer is 82", "So the answer is **82**.", "The answer is $82$.\n"]
    bad = ["The answer is 82. Let me know if you need more help!", "\\boxed{82}", "82", "The answer is eighty-two."]
    assert [format_reward(t, "nl") for t in good] == [1.0] * 4
    assert [format_reward(t, "nl") for t in bad] == [0.0] * 4


def test_verifier_workers_ignore_ctrl_c():
    """The terminal sends Ctrl-C to the whole process group, math-verify's workers included: they ignore it (the
    trainer stops them at exit), so an interrupted run prints the trainer's one line, not a worker's traceback."""
    from common.verifiers import _POOL

    assert math_rewards(["\\boxed{2}"], ["2"]) == [1.0]  # the pool is up
    pids = list((_POOL.get()._processes or {}).keys())
    assert pids
    for pid in pids:
        ignored = int(next(ln for ln in open(f"/proc/{pid}/status") if ln.startswith("SigIgn:")).split()[1], 16)
        assert ignored & (1 << (2 - 1)), pid  # bit SIGINT - 1 of the ignored-signal mask


def test_a_script_that_scores_at_top_level_gets_one_clear_error_not_a_hang(tmp_path):
    """The verifier's workers start by importing the main script (multiprocessing's forkserver); a script with no
    `if __name__ == "__main__":` guard would score again inside them and wait forever on workers of its own."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "unguarded.py"
    script.write_text(f"import sys\nsys.path.insert(0, {root!r})\nfrom common.verifiers import math_rewards\n"
                      "print(math_rewards(['\\\\boxed{1/2}'], ['0.5']))\n")  # a symbolic check: it needs the pool
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "needs its top-level code under `if __name__ == '__main__':`" in done.stderr.splitlines()[-1]
    guarded = tmp_path / "guarded.py"
    guarded.write_text(script.read_text().replace("print(", "if __name__ == '__main__':\n    print("))
    done = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[1.0]", done.stderr
