"""Problems from the embedded testbed, a local JSONL file, or a Hugging Face dataset; prompts; a resumable sampler.

    --dataset testbed                 the embedded suite (levels from --levels)
    --dataset testbed-nl              the same kind of problems in words, for chat models (common/testbed_nl.py)
    --dataset rg:chain_sum,gcd        reasoning-gym's procedural tasks, their curriculum levels from --levels
                                      (common/reasoning_gym.py)
    --dataset data/problems.jsonl     one JSON object per line; repeated questions dropped, every 10th distinct record
                                      held out (--eval-dataset: read whole)
    --dataset openai/gsm8k            any HF dataset (GSM8K, MATH-500 and similar fields)
    --dataset data/                   a local folder: data/<split>.jsonl (or .json), else read by `datasets`

Field names are detected (question/problem/prompt, answer/ground_truth, solution, level) or set with the field
options. A GSM8K-style answer ("... #### 72") is split into the final answer and the solution text.
"""

from __future__ import annotations

import codecs
import json
import os
import random
import re

from common import reasoning_gym as rg
from common.args import fail
from common.problem import Problem
from common.testbed import make_suite, render_testbed_prompt
from common.testbed_nl import NL_INSTRUCTION, make_nl_suite
from common.verifiers import strip_thousands

QUESTION_FIELDS = ("question", "problem", "prompt", "query", "input")
ANSWER_FIELDS = ("answer", "ground_truth", "final_answer", "target", "output")
SOLUTION_FIELDS = ("solution", "reasoning", "rationale")
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{{}}."
MATH_TEMPLATE = "{question}\n" + MATH_INSTRUCTION
RG_INSTRUCTION = "Think step by step, then give only the final answer between <answer> and </answer> tags."
"""The answer format asked after every reasoning-gym question (common.verifiers.extract_rg_answer reads these tags
first, then the model's own phrasing: benchmarks/premises/rg_zero_shot_smollm2.md)."""
MAX_FIELD_CHARS = 100_000
"""The longest question, answer, solution or knowledge point a record may carry, in characters: a one-line error
names the record (file and line) before any model work. 100,000 characters are about 25,000 tokens of English for a
BPE tokenizer and 100,000 for the testbed's byte tokenizer: past the context of the embedded models (testbed 512,
SmolLM2 8,192 positions), near that of Qwen2.5 (32,768), and far past any math problem; a longer field is a broken
file (one 10 MB line was accepted and the run died 84 s later allocating 51 GB). --max-prompt-tokens does not lift
it: it cuts prompts after tokenizing, and the fields are also read whole by the verifier and the samples log."""


def _kind(value) -> str:
    """The JSON name of a value's type, for error messages."""
    names = {bool: "a boolean", str: "a string", int: "a number", float: "a number", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _pick(row: dict, explicit: str | None, candidates: tuple, what: str, source: str, required: bool = True):
    if explicit:
        if explicit not in row:
            fail(f"{source}: field {explicit!r} (given for the {what}) is missing; fields are {sorted(row)}")
        return explicit
    found = next((name for name in candidates if name in row), None)
    if required and found is None:
        fail(f"{source}: no {what} field found (tried {list(candidates)}); fields are {sorted(row)}. "
             f"Name it with --{what}-field.")
    return found


def rows_to_problems(rows: list[dict], source: str, question_field=None, answer_field=None, solution_field=None,
                     level_field=None, where: list[str] | None = None) -> list[Problem]:
    """Map raw records to `Problem`s, checking every record has the fields, of usable types.
    `where[i]` names record i in errors (a file and line); by default `source` and the record number."""
    if not rows:
        fail(f"{source}: the dataset is empty")
    where = where or [source] * len(rows)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            fail(f"{where[i]}: record {i} is {_kind(row)}; expected an object with a question and an answer field")
    q_name = _pick(rows[0], question_field, QUESTION_FIELDS, "question", where[0])
    a_name = _pick(rows[0], answer_field, ANSWER_FIELDS, "answer", where[0])
    s_name = _pick(rows[0], solution_field, SOLUTION_FIELDS, "solution", where[0], required=False)
    l_name = level_field or ("level" if "level" in rows[0] else None)
    problems = []
    for i, row in enumerate(rows):
        for name in (q_name, a_name):
            if row.get(name) in (None, ""):
                fail(f"{where[i]}: record {i} has no {name!r} (fields: {sorted(row)})")
        allowed = {q_name: (str,), a_name: (str, int, float), s_name: (str, type(None)), l_name: (str, int, type(None))}
        for name, types in allowed.items():
            value = row.get(name)
            if name is not None and (not isinstance(value, types) or isinstance(value, bool)):
                want = " or ".join(dict.fromkeys(_kind(t()) for t in types if t is not float))
                fail(f"{where[i]}: record {i} field {name!r} is {_kind(value)}; expected {want}")
        kps = row.get("kp_list") or []  # candidate knowledge points (KnowRL's field name)
        if not (isinstance(kps, list) and all(isinstance(k, str) for k in kps)):
            fail(f"{where[i]}: record {i} field 'kp_list' is {_kind(kps)}; expected a list of strings")
        for name, value in [(q_name, row[q_name]), (a_name, row[a_name]), (s_name, row.get(s_name)), *(
                ("kp_list", k) for k in kps)]:
            if isinstance(value, str) and len(value) > MAX_FIELD_CHARS:
                fail(f"{where[i]}: record {i} field {name!r} is {len(value):,} characters long, over the limit of "
                     f"{MAX_FIELD_CHARS:,} (common/data.py MAX_FIELD_CHARS: far past any math problem and the "
                     "embedded models' contexts); shorten or remove that record")
        answer, solution = str(row[a_name]), str(row.get(s_name) or "") if s_name else ""
        if "####" in answer:  # GSM8K: "reasoning ... #### 72"
            parts = answer.split("####")
            solution, answer = solution or parts[0].strip(), strip_thousands(parts[-1].strip())
        level = row.get(l_name, 0) if l_name else 0
        level = int((re.findall(r"\d+", level) or [0])[0]) if isinstance(level, str) else level  # MATH: "Level 3"
        uid = str(row.get("id", row.get("unique_id", f"{source}:{i}")))
        problems.append(Problem(str(row[q_name]), answer, int(level or 0), solution, list(kps), task="math", uid=uid))
    return problems


def read_json_records(path: str) -> tuple[list, list[str]]:
    """The records of a local file, and where each one is (`file:line`): JSON lines (one object a line), or for
    a .json file one array of objects (a .json file of JSON lines, as `datasets` writes them, works too)."""
    if not os.path.isfile(path):
        fail(f"dataset file {path!r} does not exist")
    with open(path, "rb") as f:
        data = f.read().removeprefix(codecs.BOM_UTF8)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        fail(f"{path}:{line} is not UTF-8 text (byte 0x{data[e.start]:02x} at column {column}); save the file as UTF-8")
    if not text.strip():
        fail(f"{path}: the file is empty")
    if path.endswith(".json"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            doc = None  # perhaps JSON lines: read below, with the line of the first bad one
        if isinstance(doc, list):
            return doc, [path] * len(doc)
    rows, where = [], []
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                fail(f"{path}:{n} is not valid JSON ({e.msg} at column {e.colno}); expected one JSON object a line")
            where.append(f"{path}:{n}")
    return rows, where


def distinct(problems: list[Problem], where: list[str], source: str, report: bool = True,
             split: bool = True) -> list[Problem]:
    """The problems whose question (whitespace aside) no earlier one has, in file order. Split by position alone, a
    file that repeats records put copies of its held-out problems into training (all 3 of a 30-record file's), so the
    split (`split`: this file is split) is taken after this. With `report`, one console line counts what was dropped."""
    first, kept, dropped = {}, [], []
    for i, p in enumerate(problems):
        j = first.setdefault(" ".join(p.question.split()), i)
        (kept if j == i else dropped).append((i, j))
    if dropped and report and os.environ.get("RANK", "0") == "0":
        name = lambda i: f"line {where[i].rsplit(':', 1)[1]}" if where[i] != source else f"record {i}"  # noqa: E731
        other = sum(problems[i].answer != problems[j].answer for i, j in dropped)
        i, j = dropped[0]
        print(f"note: {source}: {len(dropped)} of {len(problems)} records repeat an earlier record's question and are "
              f"dropped (the first: {name(i)} repeats {name(j)}" + (f"; {other} with another answer, the earlier one "
              f"kept" if other else "") + ")" + (", so no held-out problem is also a training one" if split else "")
              + f"; {len(kept)} remain")
    return [problems[i] for i, _ in kept]


def load_problems(dataset: str, split: str = "train", levels=(2,), num_problems: int = 0, seed: int = 0,
                  dataset_config: str | None = None, question_field: str | None = None,
                  answer_field: str | None = None, solution_field: str | None = None,
                  level_field: str | None = None, whole: bool = False) -> list[Problem]:
    """The problems of one split; `num_problems` > 0 keeps the first that many of it. A local .jsonl/.json file has
    two, once every record is checked (errors name its line) and records that repeat an earlier record's question are
    dropped (`distinct`): every 10th distinct record (index % 10 == 0) is held out ('test', 'validation'), the others
    are 'train'; with `whole` (held-out problems from another file) it is read whole."""
    if dataset in ("testbed", "testbed-nl"):
        return (make_suite if dataset == "testbed" else make_nl_suite)(
            "test" if split in ("test", "validation") else "train", tuple(levels), num_problems or 500, seed)
    if rg.is_rg(dataset):
        return rg.make_rg_problems(dataset, split, tuple(levels), num_problems or 500, seed)
    where, one_file = None, dataset.endswith((".jsonl", ".json")) and not os.path.isdir(dataset)
    local = [f for f in (os.path.join(dataset, split + ext) for ext in (".jsonl", ".json")) if os.path.isfile(f)]
    if one_file:
        rows, where = read_json_records(dataset)
    elif local:  # a folder with <split>.jsonl: read it here, so that errors name the file and line
        rows, where = read_json_records(local[0])
    else:
        try:
            import datasets
        except ImportError:
            fail(f"loading the Hugging Face dataset {dataset!r} needs `pip install datasets`")
        try:
            rows = list(datasets.load_dataset(dataset, dataset_config, split=split))
        except Exception as e:  # noqa: BLE001 - the hub/cache raises many types
            fail(f"could not load dataset {dataset!r} (config {dataset_config!r}, split {split!r}): "
                 f"{type(e).__name__}: {' '.join(str(e).split())}")
    problems = rows_to_problems(rows, dataset, question_field, answer_field, solution_field, level_field, where)
    if one_file:  # once per file: by the 'train' load, or the one load of a held-out file read whole
        problems = distinct(problems, where, dataset, whole or split not in ("test", "validation"), not whole)
    if one_file and not whole:
        if len(problems) < 2:
            one = "1 record" if len(rows) == 1 else f"{len(rows)} records of 1 question"
            fail(f"{dataset}: {one}, too few to split into training and held-out problems (every 10th record is "
                 "held out); add records, or pass a separate held-out file with --eval-dataset")
        problems = [p for i, p in enumerate(problems) if (i % 10 == 0) == (split in ("test", "validation"))]
    return problems[:num_problems] if num_problems else problems


def load_train_eval(args) -> tuple[list, list]:
    """Training and held-out problems: --eval-dataset (another file: both read whole), else --dataset's --eval-split."""
    fields = dict(dataset_config=args.dataset_config, question_field=args.question_field,
                  answer_field=args.answer_field, solution_field=args.solution_field,
                  whole=os.path.realpath(args.eval_dataset or args.dataset) != os.path.realpath(args.dataset))
    train = load_problems(args.dataset, args.train_split, args.levels, args.num_train_problems, args.seed, **fields)
    held_out = load_problems(args.eval_dataset or args.dataset, args.eval_split, args.levels, args.num_eval_problems,
                             args.seed, **fields)
    if rg.is_rg(args.dataset):  # other seeds can draw the same question at a small level: none held out is trained on
        train = rg.without_held_out(train, held_out)
    return train, held_out


def render_prompt(problem: Problem, tokenizer, hints=(), suffix: str = "", template: str = MATH_TEMPLATE) -> str:
    """The text the policy sees. Testbed problems use the compact format the testbed models were trained on; others
    use `template` (testbed-nl: with its answer instruction in place of the math one), then `suffix` (text a trainer
    appends, e.g. oc_grpo.py's partial reference solution), inside the tokenizer's chat template when it has one,
    after the system turn the tokenizer's `system_prompt` asks for (common.models.load_tokenizer; None: the
    template's default)."""
    if problem.task == "testbed":
        return render_testbed_prompt(problem.question, hints)
    # hints in KnowRL's format: "{problem}\n\n## Hint\n{one per line}\n\nPlease reason step by step, ..."
    question = problem.question + ("\n\n## Hint\n" + "\n".join(hints) + "\n" if hints else "")
    if problem.task in ("nl", "rg"):  # they ask for their own answer format (also inside a trainer's own template)
        own = NL_INSTRUCTION if problem.task == "nl" else RG_INSTRUCTION
        template = template.replace(MATH_INSTRUCTION, own.replace("{", "{{").replace("}", "}}"))
    text = template.format(question=question) + suffix
    if getattr(tokenizer, "chat_template", None):
        system = getattr(tokenizer, "system_prompt", None)  # set by common.models.load_tokenizer
        messages = [{"role": "system", "content": system}] * (system is not None) + [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text


def encode_prompts(tokenizer, texts: list[str], max_prompt_tokens: int = 0) -> list[list[int]]:
    """Token ids of each prompt (no special tokens added: chat templates carry their own)."""
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [x[-max_prompt_tokens:] for x in ids] if max_prompt_tokens else ids  # the end is kept: the question is there


class PromptSampler:
    """Shuffled passes over the problems; its state (epoch, position) is saved in checkpoints."""

    def __init__(self, problems: list, seed: int):
        if not problems:
            fail("no training problems")
        self.problems, self.seed, self.epoch, self.pos = problems, seed, 0, 0
        self.order = self._order()

    def _order(self) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        return order

    def next(self, k: int) -> list:
        batch = []
        while len(batch) < k:
            if self.pos == len(self.order):
                self.epoch, self.pos = self.epoch + 1, 0
                self.order = self._order()
            batch.append(self.problems[self.order[self.pos]])
            self.pos += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self.order = self._order()
