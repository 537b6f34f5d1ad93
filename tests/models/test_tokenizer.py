"""Tokenizer loading, chat rendering, and multi-turn prompt extension without re-tokenizing."""

import json
import shutil

import pytest

from rlactors.models import extend_with_messages, load_tokenizer, render_messages


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


def test_special_tokens(tok):
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tok.encode(special, add_special_tokens=False) == [tok.convert_tokens_to_ids(special)]
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=False)


def test_render_messages_uses_chatml(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort: Bob, Al"}]
    ids = render_messages(tok, messages)
    assert tok.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSort: Bob, Al<|im_end|>\n"
        "<|im_start|>assistant\n")
    no_prompt = render_messages(tok, messages, add_generation_prompt=False)
    assert ids[:len(no_prompt)] == no_prompt
    assert tok.decode(ids[len(no_prompt):]) == "<|im_start|>assistant\n"


def completion(tok, text):
    """What a generator returns: sampled tokens ending with the stop token <|im_end|>."""
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def test_three_turn_conversation_never_changes_earlier_tokens(tok):
    conversation = [{"role": "system", "content": "Sort names."}, {"role": "user", "content": "Zoe, Al"}]
    ids = render_messages(tok, conversation)
    replies = ["Al, Zoe", "Bo, Cy, Di", "done"]
    followups = [[{"role": "user", "content": "Now: Di, Bo, Cy"}],
                 [{"role": "user", "content": "Thanks."}, {"role": "user", "content": "Anything else?"}],
                 None]
    for reply, new_messages in zip(replies, followups):
        ids = ids + completion(tok, reply)
        conversation.append({"role": "assistant", "content": reply})
        if new_messages is None:
            break
        extended = extend_with_messages(tok, ids, new_messages)
        assert extended[:len(ids)] == ids  # every earlier token untouched
        ids = extended
        conversation += new_messages
        # With canonical completions the token-level extension equals rendering it all at once.
        assert ids == render_messages(tok, conversation)
    assert ids == render_messages(tok, conversation, add_generation_prompt=False)[:-1]  # minus final "\n"


def test_non_canonical_completion_tokens_survive(tok):
    prompt = render_messages(tok, [{"role": "user", "content": "Say hello"}])
    # A sampled completion may spell "hello" with other tokens than the tokenizer would.
    sampled = [tok.convert_tokens_to_ids(c) for c in "hello"] + [tok.eos_token_id]
    assert sampled[:-1] != tok.encode("hello", add_special_tokens=False)
    ids = extend_with_messages(tok, prompt + sampled, [{"role": "user", "content": "Again"}])
    assert ids[:len(prompt) + len(sampled)] == prompt + sampled
    retokenized = render_messages(tok, [{"role": "user", "content": "Say hello"},
                                        {"role": "assistant", "content": "hello"},
                                        {"role": "user", "content": "Again"}])
    assert ids != retokenized and tok.decode(ids) == tok.decode(retokenized)


def test_truncated_completion_gets_its_turn_closed(tok):
    prompt = render_messages(tok, [{"role": "user", "content": "Count"}])
    cut_off = tok.encode("1 2 3", add_special_tokens=False)  # hit max_tokens, no <|im_end|>
    ids = extend_with_messages(tok, prompt + cut_off, [{"role": "user", "content": "Go on"}])
    assert ids[:len(prompt) + len(cut_off)] == prompt + cut_off
    assert tok.decode(ids[len(prompt) + len(cut_off):]) == (
        "<|im_end|>\n<|im_start|>user\nGo on<|im_end|>\n<|im_start|>assistant\n")


def test_extending_a_prompt_that_already_ends_a_turn(tok):
    messages = [{"role": "user", "content": "One"}]
    prompt = render_messages(tok, messages, add_generation_prompt=False)  # ends "<|im_end|>\n"
    more = [{"role": "user", "content": "Two"}]
    ids = extend_with_messages(tok, prompt, more, add_generation_prompt=False)
    assert ids == render_messages(tok, messages + more, add_generation_prompt=False)


def test_empty_messages_are_rejected(tok):
    with pytest.raises(ValueError, match="messages must not be empty"):
        render_messages(tok, [])
    with pytest.raises(ValueError, match="messages must not be empty"):
        extend_with_messages(tok, [1, 2], [])


def tokenizer_copy(tiny_ckpt, tmp_path, chat_template):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_ckpt / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if chat_template is not None:
        config["chat_template"] = chat_template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(tmp_path)


def test_missing_chat_template_is_a_clear_error(tiny_ckpt, tmp_path):
    tok = tokenizer_copy(tiny_ckpt, tmp_path, chat_template=None)
    with pytest.raises(ValueError, match="has no chat template"):
        render_messages(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="has no chat template"):
        extend_with_messages(tok, [1], [{"role": "user", "content": "hi"}])


def test_template_that_rerenders_earlier_turns_like_qwen3(tiny_ckpt, tmp_path):
    # Like Qwen3's template: an empty thinking block is shown only in the last assistant turn, so
    # the rendering of earlier turns changes once a message follows. The delta must not care.
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' and loop.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
        "{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    tok = tokenizer_copy(tiny_ckpt, tmp_path, chat_template=template)
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    later = turns + [{"role": "user", "content": "Bye"}]
    rendered_turns = render_messages(tok, turns, add_generation_prompt=False)
    assert render_messages(tok, later, add_generation_prompt=False)[:len(rendered_turns)] != rendered_turns
    prompt = render_messages(tok, [{"role": "user", "content": "Hi"}])
    sampled = completion(tok, "<think>\nhmm\n</think>\n\nHello")
    ids = extend_with_messages(tok, prompt + sampled, [{"role": "user", "content": "Bye"}])
    assert ids[:len(prompt) + len(sampled)] == prompt + sampled
    assert tok.decode(ids[len(prompt) + len(sampled):]) == "\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("template, message", [
    # Renders only the newest message: earlier turns vanish.
    ("{{ messages[-1]['content'] }}", "does not render an earlier assistant turn"),
    # Closes a turn one way when it is last and another way when more follow.
    ("{% for m in messages %}{{ m['content'] }}{% if loop.last %}<END>{% else %}<NEXT>{% endif %}"
     "{% endfor %}", "closes an assistant turn"),
])
def test_templates_without_a_stable_turn_closing_are_rejected(tiny_ckpt, tmp_path, template, message):
    tok = tokenizer_copy(tiny_ckpt, tmp_path, chat_template=template)
    with pytest.raises(ValueError, match=message):
        extend_with_messages(tok, [1, 2], [{"role": "user", "content": "hi"}])


def test_load_tokenizer_rejects_missing_dir(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
