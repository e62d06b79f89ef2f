"""The embedded grounds: the models the trainers' offline defaults run on, built here once and cached.

    testbed-weak, testbed-strong   tiny byte-level Qwen2 models warm-started on the testbed task (testbed_models.py)
    smollm2-135m-instruct          SmolLM2-135M-Instruct, converted from a pip package's GGUF file (pretrained.py)
    testbed-code                   rlpf.py's tiny code policy (code_model.py)

A trainer imports this package only when `--model-name` is one of these names (common.models.EMBEDDED_NAMES), and
turns it into a folder with `grounds.path_of(name)` (built on first use, under grounds/cache.py's lock): a fork that
copies a trainer and common/ alone runs on hub ids and local folders without grounds/. Nothing in common/ imports
this package: the builders may use common/'s sampler and log-prob kernel to measure what they build, and common/
only ever loads folders and hub ids.
"""

from grounds.pretrained import PRETRAINED_MODELS, ensure_pretrained_model
from grounds.testbed_models import CODE_MODEL, TESTBED_MODELS, ensure_testbed_model

EMBEDDED_MODELS = (*TESTBED_MODELS, *PRETRAINED_MODELS, CODE_MODEL)


def path_of(name: str) -> str:
    """The folder of embedded model `name`, matched without regard to case (`SmolLM2-135M-Instruct` is
    smollm2-135m-instruct), built and cached on first use; any other name is returned unchanged."""
    name = name.lower() if name.lower() in EMBEDDED_MODELS else name
    if name in TESTBED_MODELS:
        return ensure_testbed_model(name)
    if name in PRETRAINED_MODELS:
        return ensure_pretrained_model(name)
    if name == CODE_MODEL:  # imported only now: only rlpf.py uses it, and it needs rlpf's code_env/
        from grounds.code_model import ensure_code_model

        return ensure_code_model()
    return name
