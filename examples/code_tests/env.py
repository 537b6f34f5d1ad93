"""code_tests: the policy writes a small Python function; the env runs it against tests in a sandbox.

Each sample asks for one function from a few seeded task families (a linear formula, divisibility,
string repetition, counting list elements above a bound), with one worked example. The reply's last
```python block (the whole reply when it has none) is saved as solution.py and run, with a test
runner, in rlactors.envs.sandbox: no network, no files but its own, bounded time, memory, processes and
output. The reward "tests" is the share of the tests its last attempt passed; an attempt that
fails some is answered with the first failure (or how the program ended: timeout, memory, ...),
and the policy may try again, up to `max_attempts` attempts.

The runner reads a random token from stdin before it imports the solution and prints it with the
result, so a solution that prints a result line of its own does not score; a solution that ends
the process (sys.exit, os._exit) before the runner reports scores 0.
"""

from __future__ import annotations

import json
import random
import re
import secrets
from dataclasses import dataclass
from typing import Any

from rlactors.config import ConfigError
from rlactors.envs.sandbox import Sandbox, SandboxLimits, SandboxResult
from rlactors.rollout import MessageEnv, MessageStep
from rlactors.types import Completion

SPLITS = ("train", "eval")
SYSTEM = "You write Python. Answer with one ```python code block that defines the function asked for."
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)

# Runs the tests of tests.json against solution.py; its last stdout line: "<token> <passed> <total> <first failure>".
RUNNER = """\
import json, sys
token = sys.stdin.readline().strip()
spec = json.load(open("/sandbox/tests.json"))
passed, failure = 0, None
try:
    import solution
    function = getattr(solution, spec["name"])
except BaseException as e:
    function, failure = None, f"solution.py: {type(e).__name__}: {e}"
for args, expected in spec["cases"] if function is not None else []:
    call = f"{spec['name']}({', '.join(map(repr, args))})"
    try:
        got = function(*args)
    except Exception as e:
        got, error = None, f"{call} raised {type(e).__name__}: {e}"
    else:
        error = None if got == expected else f"{call} returned {got!r}, expected {expected!r}"
    passed += error is None
    failure = failure or error
print(token, passed, len(spec["cases"]), json.dumps(failure or ""), flush=True)
"""


@dataclass
class CodeTestsConfig:
    seed: int = 0
    num_samples: int = 1000  # train split
    num_eval_samples: int = 100
    tests_per_task: int = 5
    max_attempts: int = 2  # the first answer, and retries after feedback
    wall_s: float = 5.0  # per attempt
    memory_mb: int = 256  # address space per process
    max_parallel: int = 4  # sandboxes running at once (of all rollouts)

    def __post_init__(self) -> None:
        for key in ("num_samples", "num_eval_samples", "tests_per_task", "max_attempts", "memory_mb", "max_parallel"):
            if getattr(self, key) < 1:
                raise ConfigError(f"env.args.{key}: must be >= 1, got {getattr(self, key)}")
        if not self.wall_s > 0:
            raise ConfigError(f"env.args.wall_s: must be > 0, got {self.wall_s}")


def _linear(rng: random.Random, n: int) -> dict[str, Any]:
    a, b = rng.randint(2, 9), rng.randint(1, 20)
    xs = rng.sample(range(-20, 50), n + 1)
    return {"name": "f", "text": f"Write a Python function `f(x)` that returns {a} * x + {b}.",
            "cases": [[[x], a * x + b] for x in xs], "solution": f"def f(x):\n    return {a} * x + {b}\n"}


def _divisible(rng: random.Random, n: int) -> dict[str, Any]:
    a = rng.randint(2, 9)
    xs = [a * rng.randint(1, 20) if i % 2 else rng.randint(1, 200) for i in range(n + 1)]
    return {"name": "is_multiple", "text": f"Write a Python function `is_multiple(n)` that returns True when n is "
            f"divisible by {a}, else False.", "cases": [[[x], x % a == 0] for x in xs],
            "solution": f"def is_multiple(n):\n    return n % {a} == 0\n"}


def _repeat(rng: random.Random, n: int) -> dict[str, Any]:
    a, sep = rng.randint(2, 4), rng.choice(["-", ",", " ", "+"])
    words = rng.sample(["ab", "cat", "x", "sun", "hi", "tree", "no", "yes", "red", "zz"], n + 1)
    return {"name": "repeat", "text": f"Write a Python function `repeat(s)` that returns the string s repeated {a} "
            f"times, joined by {sep!r}.", "cases": [[[w], sep.join([w] * a)] for w in words],
            "solution": f"def repeat(s):\n    return {sep!r}.join([s] * {a})\n"}


def _count_above(rng: random.Random, n: int) -> dict[str, Any]:
    a = rng.randint(0, 10)
    lists = [[rng.randint(-5, 15) for _ in range(rng.randint(0, 6))] for _ in range(n + 1)]
    return {"name": "count_above", "text": f"Write a Python function `count_above(xs)` that returns how many numbers "
            f"in the list xs are greater than {a}.", "cases": [[[xs], sum(x > a for x in xs)] for xs in lists],
            "solution": f"def count_above(xs):\n    return sum(1 for x in xs if x > {a})\n"}


FAMILIES = (_linear, _divisible, _repeat, _count_above)


def make_task(rng: random.Random, tests: int) -> dict[str, Any]:
    """A task: its function's name, the request (with one worked example), `tests` cases and a
    reference solution (a teacher's, for warm starts and tests)."""
    task = rng.choice(FAMILIES)(rng, tests)
    (args, expected), cases = task["cases"][0], task["cases"][1:]
    example = f"{task['name']}({', '.join(map(repr, args))}) == {expected!r}"
    return {"name": task["name"], "prompt": f"{task['text']} For example, {example}.", "cases": cases,
            "solution": task["solution"]}


def extract_code(reply: str) -> str:
    """The reply's last ```python block, or the whole reply when it has none."""
    blocks = _CODE_BLOCK.findall(reply)
    return blocks[-1] if blocks else reply


def tests_passed(result: SandboxResult, token: str) -> tuple[int, int, str]:
    """(passed, total, first failure) from the runner's report; (0, 0, why) when it made none."""
    for line in reversed(result.stdout.splitlines()):
        parts = line.split(" ", 3)
        if len(parts) == 4 and parts[0] == token:
            return int(parts[1]), int(parts[2]), json.loads(parts[3])
    return 0, 0, f"the program did not finish its tests: {result.describe()}"


class CodeTestsEnv(MessageEnv):
    Config = CodeTestsConfig

    def __init__(self, config: CodeTestsConfig | None = None, tokenizer: Any = None,
                 sandbox: Sandbox | None = None) -> None:
        super().__init__(config, tokenizer)
        c = self.config
        self.sandbox = sandbox or Sandbox(SandboxLimits(wall_s=c.wall_s, cpu_s=max(1, round(c.wall_s)),
                                                        memory_bytes=c.memory_mb << 20), max_parallel=c.max_parallel)

    def clone(self) -> CodeTestsEnv:
        return type(self)(self.config, self.tokenizer, self.sandbox)  # one sandbox: max_parallel holds for all

    def dataset(self, split: str) -> list[dict[str, Any]]:
        if split not in SPLITS:
            raise ValueError(f"code_tests split must be one of {SPLITS}, got {split!r}")
        rng = random.Random(f"code_tests:{self.config.seed}:{split}")
        size = self.config.num_samples if split == "train" else self.config.num_eval_samples
        return [make_task(rng, self.config.tests_per_task) for _ in range(size)]

    async def start(self, sample: dict[str, Any]) -> list[dict[str, str]]:
        self.sample, self.attempts = sample, 0
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": sample["prompt"]}]

    async def respond(self, reply: str, completion: Completion) -> MessageStep:
        self.attempts += 1
        token = secrets.token_hex(16)
        tests = json.dumps({"name": self.sample["name"], "cases": self.sample["cases"]})
        result = await self.sandbox.run(RUNNER, files={"solution.py": extract_code(reply), "tests.json": tests},
                                        stdin=token + "\n")
        passed, total, failure = tests_passed(result, token)
        info = {"passed": passed, "outcome": result.outcome.value}
        if passed == len(self.sample["cases"]) or self.attempts == self.config.max_attempts:
            return MessageStep(None, {"tests": passed / len(self.sample["cases"])}, done=True, info=info)
        feedback = f"{passed} of {total} tests passed. {failure}" if total else failure
        return MessageStep([{"role": "user", "content": f"{feedback}\nFix the function."}], reward={}, info=info)
