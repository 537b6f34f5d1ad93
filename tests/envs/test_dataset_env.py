"""DatasetEnv: config and data errors, splits, ids, prompts, scoring of full rollouts, resumable order."""

import asyncio
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlactors.config import ConfigError, EnvConfig, RolloutConfig
from rlactors.envs.data import DataError
from rlactors.models.tokenizer import load_tokenizer, render_messages
from rlactors.rollout import Rollouter, RolloutStatus, SampleStream, load_env
from rlactors.rollout.rewards import math_verify_installed
from rlactors.types import Completion

ENV = "rlactors.envs:DatasetEnv"
PROBLEMS = [{"question": f"Tom has {i} apples and buys 2 more. How many now?",
             "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"} for i in range(20)]


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


@pytest.fixture
def train_file(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", PROBLEMS)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def make_env(tok, **args):
    return load_env(EnvConfig(name=ENV, args=args), tok)


@pytest.mark.parametrize("args, message", [
    ({}, "env.args.train_path: must name the training data"),
    ({"train_path": "t.jsonl", "eval_fraction": 1.0}, r"env.args.eval_fraction: must be in \[0, 1\), got 1.0"),
    ({"train_path": "t.jsonl", "eval_fraction": 0.1, "eval_path": "e.jsonl"},
     "env.args.eval_fraction: give the eval split as eval_path or as eval_fraction, not both"),
    ({"train_path": "t.jsonl", "prompt_template": "Solve: {question}"},
     "env.args.prompt_template: must contain {prompt}"),
    ({"train_path": "t.jsonl", "chat_template": "/no/such/template.jinja"},
     "env.args.chat_template: file not found: /no/such/template.jinja"),
    ({"train_path": "t.jsonl", "extract": []}, "env.args.extract: must list at least one of boxed"),
    ({"train_path": "t.jsonl", "extract": ["boxed", "boxed"]}, "env.args.extract: lists a method twice"),
    ({"train_path": "t.jsonl", "extract": ["boxed", "regex"]},
     r"env.args.extract\[1\]: expected one of 'boxed', 'hash', 'last_number', got 'regex'"),
    ({"train_path": "t.jsonl", "extract": "boxed"}, "env.args.extract: expected a list, got 'boxed'"),
    ({"train_path": "t.jsonl", "format_pattern": "\\boxed{("}, "env.args.format_pattern: not a regular expression"),
    ({"train_path": "t.jsonl", "correct_weight": float("inf")}, "env.args.correct_weight: must be finite"),
    ({"train_path": "t.jsonl", "verifier": "sympy"}, "env.args.verifier: expected one of"),
    ({"train_path": "t.jsonl", "prompt_feld": "q"}, "env.args.prompt_feld: unknown key"),
])
def test_bad_args_are_named(tok, args, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        make_env(tok, **args)


def test_splits_from_files_keep_file_order_and_ids(tok, tmp_path, train_file):
    eval_file = write_jsonl(tmp_path / "eval.jsonl", PROBLEMS[:3])
    env = make_env(tok, train_path=train_file, eval_path=eval_file)
    train, eval_ = env.dataset("train"), env.dataset("eval")
    assert [s["id"] for s in train] == [f"train.jsonl:{i}" for i in range(1, 21)]
    assert [s["id"] for s in eval_] == ["eval.jsonl:1", "eval.jsonl:2", "eval.jsonl:3"]
    assert train[4] == {"id": "train.jsonl:5", "prompt": PROBLEMS[4]["question"], "answer": "6"}
    with pytest.raises(ValueError, match="split must be one of"):
        env.dataset("test")
    with pytest.raises(ConfigError, match="^env.args.eval_path: no eval split: set eval_path or eval_fraction$"):
        make_env(tok, train_path=train_file).dataset("eval")


def test_held_out_fraction_is_seeded_and_disjoint(tok, tmp_path, train_file):
    env = make_env(tok, train_path=train_file, eval_fraction=0.25, split_seed=1)
    train, eval_ = env.dataset("train"), env.dataset("eval")
    assert len(eval_) == 5 and len(train) == 15
    ids = [s["id"] for s in train + eval_]
    assert sorted(ids) == sorted(f"train.jsonl:{i}" for i in range(1, 21))
    rows = [int(s["id"].split(":")[1]) for s in train]
    assert rows == sorted(rows)  # file order
    again = make_env(tok, train_path=train_file, eval_fraction=0.25, split_seed=1)
    assert again.dataset("eval") == eval_ and again.dataset("train") == train
    other = make_env(tok, train_path=train_file, eval_fraction=0.25, split_seed=2).dataset("eval")
    assert other != eval_
    one = write_jsonl(tmp_path / "one.jsonl", PROBLEMS[:1])
    with pytest.raises(DataError, match=f"^env.args.eval_fraction: {one}: holding out 0.5 of 1 records leaves none$"):
        make_env(tok, train_path=one, eval_fraction=0.5).dataset("train")


def test_ids_from_a_field_must_be_unique(tok, tmp_path):
    records = [{**p, "uid": f"p{i}"} for i, p in enumerate(PROBLEMS[:3])]
    env = make_env(tok, train_path=write_jsonl(tmp_path / "a.jsonl", records), id_field="uid")
    assert [s["id"] for s in env.dataset("train")] == ["p0", "p1", "p2"]
    records[2]["uid"] = "p0"
    path = write_jsonl(tmp_path / "b.jsonl", records)
    with pytest.raises(DataError, match=f"^{path}: row 3: field 'uid' repeats the id 'p0' of row 1$"):
        make_env(tok, train_path=path, id_field="uid").dataset("train")


@pytest.mark.parametrize("record, message", [
    ({"answer": "3"}, r"row 2: field 'question' is missing \(fields: answer\)"),
    ({"question": "q"}, r"row 2: field 'answer' is missing \(fields: question\)"),
    ({"question": "  ", "answer": "3"}, "row 2: field 'question' is empty"),
    ({"question": "q", "answer": None}, r"row 2: field 'answer' is empty \(null\)"),
    ({"question": {"text": "q"}, "answer": "3"}, "row 2: field 'question' must be text, got dict"),
    ({"question": [{"role": "user"}], "answer": "3"},
     "row 2: field 'question' must be text or a list of {role, content} messages"),
    ({"question": "q", "answer": "worked out\n#### "},
     r"row 2: field 'answer' marks an answer \(#### or \\boxed{}\) but gives none"),
])
def test_bad_records_name_the_file_row_and_field(tok, tmp_path, record, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [PROBLEMS[0], record])
    with pytest.raises(DataError, match=f"^{path}: {message}$"):
        make_env(tok, train_path=path).dataset("train")


def test_numbers_nested_fields_and_message_prompts(tok, tmp_path):
    """verl-style records: the prompt a list of messages, the answer a number in a nested field."""
    records = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "reward_model": {"ground_truth": 4}}]
    env = make_env(tok, train_path=write_jsonl(tmp_path / "verl.jsonl", records), prompt_field="prompt",
                   answer_field="reward_model.ground_truth", system_prompt="Be brief.")
    sample = env.dataset("train")[0]
    assert sample["answer"] == "4"
    messages = asyncio.run(env.clone().start(sample))
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def test_the_prompt_is_the_system_prompt_and_the_template_through_the_chat_template(tok, tmp_path, train_file):
    env = make_env(tok, train_path=train_file, system_prompt="Answer in \\boxed{}.",
                   prompt_template="Problem: {prompt}\nThink first.")
    sample = env.dataset("train")[0]
    obs = asyncio.run(env.clone().reset(sample))
    assert obs.prompt_token_ids == render_messages(tok, [
        {"role": "system", "content": "Answer in \\boxed{}."},
        {"role": "user", "content": f"Problem: {PROBLEMS[0]['question']}\nThink first."}])

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
    plain = make_env(tok, train_path=train_file, chat_template=str(template))
    obs = asyncio.run(plain.clone().reset(sample))
    assert tok.decode(obs.prompt_token_ids) == f"user: {PROBLEMS[0]['question']}\nassistant:"
    assert "<|im_start|>" in tok.chat_template  # the caller's tokenizer keeps its template


class ScriptedReplies:
    """A fake generator: rollout i of every group replies `replies[i]` (encoded with the real tokenizer)."""

    def __init__(self, tok, replies):
        self.tok, self.replies = tok, replies

    async def __call__(self, prompt, sampling, request_id, session_id=None):
        index = int(request_id.split("/")[1])
        tokens = self.tok.encode(self.replies[index], add_special_tokens=False) + [self.tok.eos_token_id]
        finish = "stop"
        if len(tokens) > sampling.max_tokens:
            tokens, finish = tokens[:sampling.max_tokens], "length"
        return Completion(request_id, list(prompt), tokens, [-1.0] * len(tokens), [0] * len(tokens), finish)


def test_rollouts_are_scored_by_correctness_and_format(tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "Half of one?", "answer": "#### 1/2"}])
    env = make_env(tok, train_path=path, correct_weight=1.0, format_weight=0.25, verifier="builtin")
    replies = [r"It is \boxed{\frac{1}{2}}.", "So 1 / 2 = 0.5\n#### 0.5", r"\boxed{2}, or is it 0.5?",
               "I have no idea.", "0.50 dollars"]
    config = RolloutConfig(group_size=len(replies), max_turns=1, max_tokens_per_turn=64, max_total_tokens=512)
    group = asyncio.run(Rollouter(env, ScriptedReplies(tok, replies), config).collect(env.dataset("train"))).groups[0]
    got = [(r.reward_components, r.reward, r.turns[0].info["answer"]) for r in group.rollouts]
    assert got == [
        ({"correct": 1.0, "format": 1.0}, 1.25, r"\frac{1}{2}"),
        ({"correct": 1.0, "format": 0.0}, 1.0, "0.5"),
        ({"correct": 0.0, "format": 1.0}, 0.25, "2"),  # the boxed answer counts, not the last number
        ({"correct": 0.0, "format": 0.0}, 0.0, None),
        ({"correct": 1.0, "format": 0.0}, 1.0, "0.50"),
    ]
    assert all(r.status is RolloutStatus.COMPLETED for r in group.rollouts)
    assert len(group.episodes) == len(replies)


def test_the_dataset_order_resumes_exactly(tok, train_file):
    """A new env on the same data gives the same samples, so a SampleStream restored from a
    checkpoint's state continues with exactly the samples an uninterrupted run would have taken."""
    env = make_env(tok, train_path=train_file, eval_fraction=0.2)
    straight = SampleStream(env.dataset("train"), seed=5)
    expected = [straight.next(7) for _ in range(4)]  # 28 samples: past the end of the first epoch (16)
    first = SampleStream(env.dataset("train"), seed=5)
    taken = [first.next(7) for _ in range(2)]
    state = json.loads(json.dumps(first.state_dict()))  # as the checkpoint stores it
    resumed = SampleStream(make_env(tok, train_path=train_file, eval_fraction=0.2).dataset("train"), seed=5)
    resumed.load_state_dict(state)
    assert taken + [resumed.next(7) for _ in range(2)] == expected
    assert len({s["id"] for batch in expected[:2] for s in batch}) == 14  # no repeat within an epoch


@pytest.mark.skipif(not math_verify_installed(), reason="math-verify is not installed")
def test_math_verify_scores_inside_the_rollouter(tok, tmp_path):
    record = {"problem": "Simplify 2/sqrt(2).", "solution": r"It is $\boxed{\sqrt{2}}$."}
    path = write_jsonl(tmp_path / "t.jsonl", [record])
    replies = [r"\boxed{\frac{2}{\sqrt{2}}}", r"\boxed{\sqrt{3}}"]
    config = RolloutConfig(group_size=2, max_turns=1, max_tokens_per_turn=64, max_total_tokens=512)
    scores = {}
    for verifier in ("builtin", "math_verify"):
        env = make_env(tok, train_path=path, prompt_field="problem", answer_field="solution", verifier=verifier)
        batch = asyncio.run(Rollouter(env, ScriptedReplies(tok, replies), config).collect(env.dataset("train")))
        scores[verifier] = [r.reward_components["correct"] for r in batch.groups[0].rollouts]
    assert scores == {"builtin": [0.0, 0.0], "math_verify": [1.0, 0.0]}


def test_gsm8k_and_math_shaped_parquet_with_the_readme_args(tok, tmp_path):
    gsm8k = [{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
                          "in May. How many clips did Natalia sell altogether in April and May?",
              "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 "
                        "clips altogether in April and May.\n#### 72"}] * 3
    pq.write_table(pa.Table.from_pylist(gsm8k), tmp_path / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(gsm8k[:1]), tmp_path / "test-00000-of-00001.parquet")
    env = make_env(tok, train_path=str(tmp_path / "train-00000-of-00001.parquet"),
                   eval_path=str(tmp_path / "test-00000-of-00001.parquet"), prompt_field="question",
                   answer_field="answer")
    assert [s["answer"] for s in env.dataset("train")] == ["72"] * 3 and len(env.dataset("eval")) == 1

    math = [{"problem": f"What is {i}/4 in lowest terms?", "level": "Level 1", "type": "Algebra",
             "solution": f"Reduce: $\\boxed{{\\frac{{{i}}}{{4}}}}$."} for i in range(1, 21)]
    pq.write_table(pa.Table.from_pylist(math), tmp_path / "math.parquet")
    env = make_env(tok, train_path=str(tmp_path / "math.parquet"), eval_fraction=0.05, prompt_field="problem",
                   answer_field="solution")
    train, eval_ = env.dataset("train"), env.dataset("eval")
    assert len(train) == 19 and len(eval_) == 1
    assert train[0] == {"id": "math.parquet:1", "prompt": "What is 1/4 in lowest terms?", "answer": r"\frac{1}{4}"}
