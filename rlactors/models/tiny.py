"""Random-init checkpoints of each family with a small byte-level BPE tokenizer, for tests and CPU demos.

    python -m rlactors.models.tiny OUT_DIR [--family qwen3|qwen3_moe|qwen2|llama] [--size SIZE] [--seed N] [--no-tie]
                                   [--no-weights]

Sizes: ``tiny`` and ``small`` for every family, and the shapes of real models: ``0.6b``, ``1.7b``
(Qwen3), ``30b-a3b``, ``235b-a22b`` and ``30b-a3b-4l`` (4 of Qwen3-30B-A3B's 48 layers)
(Qwen3-MoE), ``0.5b`` (Qwen2.5), ``1b`` (Llama 3.2). A tiny
or small Qwen3-MoE has a dense first layer and sparse others, with ``norm_topk_prob`` on, as
the real ones have. Each family gets its real models' RoPE: Qwen's
theta 1e6, Llama 3.2's theta 5e5 with its ``llama3`` scaling (factor 32 beyond 8192 positions).
The directory holds HF-standard files (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a ChatML chat template, generation_config.json), so it loads here,
in HF transformers and in vLLM. The same seed gives bitwise the same weights and tokenizer.
"""

from __future__ import annotations

import argparse
import functools
import json
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from rlactors.models.args import DTYPES, FAMILIES, Llama3RopeScaling, ModelArgs, MoEArgs
from rlactors.models.checkpoint import CONFIG_FILE, model_shapes, save_pretrained

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TOKENIZER_VOCAB_SIZE = 1024  # specials included; a multiple of 64, so no padded model rows

# Qwen-style ChatML. Our own minimal template: no thinking blocks. With `tools`, a system turn lists
# them (merged with a leading system message) and says how to call one, Hermes style; an assistant
# turn's `tool_calls` render as `<tool_call>` JSON blocks (arguments as an object), and a `tool`
# message as a user turn holding a `<tool_response>`. Without tools a conversation renders as plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call these functions:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call one, reply with <tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <arguments-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# name: (hidden, intermediate, layers, q heads, kv heads, head_dim, vocab or None,
#        max positions or None (the family's), dtype)
SIZES: dict[str, tuple] = {  # any family
    "tiny": (128, 384, 4, 4, 2, 32, None, None, "float32"),
    "small": (256, 768, 6, 8, 4, 32, None, None, "float32"),
}
REAL_SIZES: dict[str, dict[str, tuple]] = {  # family: the shapes of its real models
    "qwen3": {"0.6b": (1024, 3072, 28, 16, 8, 128, 151936, 40960, "bfloat16"),  # Qwen3-0.6B
              "1.7b": (2048, 6144, 28, 16, 8, 128, 151936, 40960, "bfloat16"),  # Qwen3-1.7B
              "8b": (4096, 12288, 36, 32, 8, 128, 151936, 40960, "bfloat16")},  # Qwen3-8B
    "qwen3_moe": {"30b-a3b": (2048, 6144, 48, 32, 4, 128, 151936, 40960, "bfloat16"),  # Qwen3-30B-A3B
                  # Qwen3-30B-A3B's layers, 4 of its 48: trains on one 80 GB GPU
                  "30b-a3b-4l": (2048, 6144, 4, 32, 4, 128, 151936, 40960, "bfloat16"),
                  "235b-a22b": (4096, 12288, 94, 64, 4, 128, 151936, 40960, "bfloat16")},  # Qwen3-235B-A22B
    "qwen2": {"0.5b": (896, 4864, 24, 14, 2, 64, 151936, 32768, "bfloat16")},  # Qwen2.5-0.5B
    "llama": {"1b": (2048, 8192, 16, 32, 8, 64, 128256, 131072, "bfloat16")},  # Llama-3.2-1B
}
# family: (rope_theta, rope_scaling) of its real models (Qwen2.5 and Qwen3; Llama 3.2), and the
# max positions of tiny/small (Llama's must exceed the scaling's original 8192).
FAMILY_ROPE: dict[str, tuple[float, Llama3RopeScaling | None, int]] = {
    "qwen3": (1_000_000.0, None, 4096),
    "qwen3_moe": (1_000_000.0, None, 4096),
    "qwen2": (1_000_000.0, None, 4096),
    "llama": (500_000.0, Llama3RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192), 131072),
}

# The experts of each Qwen3-MoE size.
MOE_SIZES: dict[str, MoEArgs] = {
    "tiny": MoEArgs(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                    mlp_only_layers=(0,)),
    "small": MoEArgs(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True,
                     mlp_only_layers=(0,)),
    "30b-a3b": MoEArgs(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    "30b-a3b-4l": MoEArgs(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    "235b-a22b": MoEArgs(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536, norm_topk_prob=True),
}


_WORDS = """
the of and to a in is you that it he was for on are as with his they at be this have from or
one had by word but not what all were we when your can said there use an each which she do how
their if will up other about out many then them these so some her would make like him into time
has look two more write go see number no way could people my than first water been call who oil
its now find long down day did get come made may part sort sorted sorting order alphabetical
alphabetically list names name letter letters first last answer question please following
input output correct wrong reward yes here given below above only return each line comma space
user assistant system think step words word count numbers sum add subtract multiply result final
""".split()
_FIRST_NAMES = """
James Mary John Patricia Robert Jennifer Michael Linda William Elizabeth David Barbara Richard
Susan Joseph Jessica Thomas Sarah Charles Karen Christopher Nancy Daniel Lisa Matthew Betty
Anthony Margaret Mark Sandra Donald Ashley Steven Kimberly Paul Emily Andrew Donna Joshua
Michelle Kenneth Dorothy Kevin Carol Brian Amanda George Melissa Edward Deborah Ronald Stephanie
Timothy Rebecca Jason Sharon Jeffrey Laura Ryan Cynthia Jacob Kathleen Gary Amy Nicholas Shirley
Eric Angela Jonathan Helen Stephen Anna Larry Brenda Justin Pamela Scott Nicole Brandon Emma
Benjamin Samantha Samuel Katherine Gregory Christine Frank Debra Alexander Rachel Raymond
Catherine Patrick Carolyn Jack Janet Dennis Ruth Jerry Maria Tyler Heather Aaron Diane Jose
Virginia Adam Julie Henry Joyce Nathan Victoria Douglas Olivia Zachary Kelly Peter Christina
Kyle Lauren Walter Joan Ethan Evelyn Jeremy Judith Harold Megan Keith Cheryl Christian Andrea
Roger Hannah Noah Martha Gerald Jacqueline Carl Frances Terry Gloria Sean Ann Austin Teresa
Arthur Kathryn Lawrence Sara Jesse Janice Dylan Jean Bryan Alice Joe Madison Jordan Doris Billy
Abigail Bruce Julia Albert Judy Willie Grace Gabriel Denise Logan Amber Alan Marilyn Juan Beverly
Wayne Danielle Roy Theresa Ralph Sophia Randy Marie Eugene Diana Vincent Brittany Russell Natalie
Elijah Isabella Louis Charlotte Bobby Rose Philip Alexis Johnny Kayla Zoe Quinn Xavier Yusuf
Uma Ivan Oscar Victor Wendy Yvonne Zara Ursula Quentin Xena
""".split()
_LAST_NAMES = """
Smith Johnson Williams Brown Jones Garcia Miller Davis Rodriguez Martinez Hernandez Lopez
Gonzalez Wilson Anderson Thomas Taylor Moore Jackson Martin Lee Perez Thompson White Harris
Sanchez Clark Ramirez Lewis Robinson Walker Young Allen King Wright Scott Torres Nguyen Hill
Flores Green Adams Nelson Baker Hall Rivera Campbell Mitchell Carter Roberts Gomez Phillips Evans
Turner Diaz Parker Cruz Edwards Collins Reyes Stewart Morris Morales Murphy Cook Rogers Gutierrez
Ortiz Morgan Cooper Peterson Bailey Reed Kelly Howard Ramos Kim Cox Ward Richardson Watson Brooks
Chavez Wood James Bennett Gray Mendoza Ruiz Hughes Price Alvarez Castillo Sanders Patel Myers
Long Ross Foster Jimenez Powell Jenkins Perry Russell Sullivan Bell Coleman Butler Henderson
Barnes Gonzales Fisher Vasquez Simmons Romero Jordan Patterson Alexander Hamilton Graham Reynolds
Griffin Wallace Moreno West Cole Hayes Bryant Herrera Gibson Ellis Tran Medina Aguilar Stevens
Murray Ford Castro Marshall Owens Harrison Fernandez McDonald Woods Washington Kennedy Wells
Vargas Henry Chen Freeman Webb Tucker Guzman Burns Crawford Olson Simpson Porter Hunter Gordon
Mendez Silva Shaw Snyder Mason Dixon Munoz Hunt Hicks Holmes Palmer Wagner Black Robertson Boyd
Rose Stone Salazar Fox Warren Mills Meyer Rice Schmidt Garza Daniels Ferguson Nichols Stephens
Soto Weaver Ryan Gardner Payne Grant Dunn Kelley Spencer Hawkins Arnold Pierce Vazquez Hansen
Peters Santos Hart Bradley Knight Elliott Cunningham Duncan Armstrong Hudson Carroll Lane Riley
Andrews Alvarado Ray Delgado Berry Perkins Hoffman Johnston Matthews Pena Richards Contreras
Willis Carpenter Lawrence Sandoval Young Xu Zhang Quinn Underwood Yates Zimmerman Vaughn
""".split()
_TAGS = ("alphabetical_sorted", "unsorted", "sorted", "names", "answer", "think", "list", "input",
         "output", "result", "reasoning")


def _corpus() -> list[str]:
    """A fixed training corpus built from the lists above. Repetition sets merge priority: tags
    and task words first, then names in list form (" Name"), then everything else."""
    lines = [string.ascii_letters, string.digits, string.punctuation, " ".join(string.punctuation)]
    for tag in _TAGS:
        lines += [f"<{tag}>\n", f"</{tag}>\n", f" <{tag}> </{tag}>"] * 40
    lines += [" ".join(_WORDS), " ".join(w.capitalize() for w in _WORDS)] * 10
    for i, first in enumerate(_FIRST_NAMES):
        last = _LAST_NAMES[(7 * i) % len(_LAST_NAMES)]
        lines += [f" {first} {last},\n{first} {last}\n"] * 3
        lines.append(f"{first.lower()} {last.lower()} {first.upper()} {last.upper()}")
    for last in _LAST_NAMES:
        lines += [f" {last},\n{last}\n"] * 3
        lines.append(f"{last.lower()} {last.upper()}")
    lines += [f"{n} {n + 1}, {n * 3}. {n}: {n % 10}" for n in range(0, 1000, 7)]
    for role in ("system", "user", "assistant"):
        lines += [f"{IM_START}{role}\nSort these names alphabetically.{IM_END}\n"] * 20
    return lines


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE over the built-in corpus; any byte string encodes, and training is deterministic."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    return tokenizer


@functools.cache
def _trained_tokenizer_json() -> str:
    """``train_tokenizer()`` serialized, trained once per process (it takes about a second)."""
    return train_tokenizer().to_str()


def size_args(size: str, vocab_size: int, tie_word_embeddings: bool = True,
              dtype: str | None = None, eos_token_id: int | None = None,
              bos_token_id: int | None = None, family: str = "qwen3") -> ModelArgs:
    """The ModelArgs of a named size of ``family``; tiny/small take the vocab rounded up to a
    multiple of 64."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    shapes = {**SIZES, **REAL_SIZES[family]}
    if size not in shapes:
        raise ValueError(f"size must be one of {list(shapes)} for family {family!r}, got {size!r}")
    hidden, inter, layers, heads, kv_heads, head_dim, fixed_vocab, max_pos, default_dtype = shapes[size]
    if fixed_vocab is not None and vocab_size > fixed_vocab:
        raise ValueError(f"tokenizer has {vocab_size} tokens, more than size {size!r}'s vocab {fixed_vocab}")
    rope_theta, rope_scaling, family_max_pos = FAMILY_ROPE[family]
    return ModelArgs(
        vocab_size=fixed_vocab or -(-vocab_size // 64) * 64,
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, model_type=family,
        rms_norm_eps=1e-6, rope_theta=rope_theta, rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings, max_position_embeddings=max_pos or family_max_pos,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, torch_dtype=dtype or default_dtype,
        moe=MOE_SIZES[size] if FAMILIES[family].moe else None)


def random_state_dict(args: ModelArgs, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    """HF's init (normal(0, std) matrices, ones for norms), drawn in fp32 on CPU one tensor at a
    time from one generator, then cast: the same seed gives the same weights bitwise. Biases are
    drawn like the matrices (HF's init zeroes them), so that tests exercise them. The model's
    names (fused experts: ``save_pretrained`` writes them one by one)."""
    generator = torch.Generator().manual_seed(seed)
    state_dict = {}
    for name, shape in model_shapes(args).items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape)
        else:
            tensor = torch.empty(shape).normal_(0.0, std, generator=generator)
        state_dict[name] = tensor.to(args.dtype)
    return state_dict


def make_tiny_checkpoint(out_dir: str | Path, size: str = "tiny", seed: int = 0,
                         tie_word_embeddings: bool = True, dtype: str | None = None,
                         family: str = "qwen3", weights: bool = True) -> Path:
    """Writes a random-init checkpoint dir of ``family`` with tokenizer; ``dtype=None`` is fp32
    for tiny/small and bf16 for the real models' shapes. ``weights=False`` writes no weights,
    only the config and tokenizer files: what vLLM needs to serve the shape with its dummy
    weights (``load_format="dummy"``), at sizes whose weights would not fit the disk."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out_dir = Path(out_dir)
    tokenizer = Tokenizer.from_str(_trained_tokenizer_json())
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    args = size_args(size, tokenizer.get_vocab_size(), tie_word_embeddings, dtype,
                     eos_token_id=ids[IM_END], bos_token_id=ids[ENDOFTEXT], family=family)
    if weights:
        save_pretrained(random_state_dict(args, seed), args, out_dir)
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / CONFIG_FILE).write_text(json.dumps(args.to_hf_config(), indent=2) + "\n")
    _write_tokenizer(tokenizer, out_dir)
    generation_config = {"bos_token_id": ids[ENDOFTEXT], "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
                         "pad_token_id": ids[ENDOFTEXT]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    return out_dir


def kept_checkpoint(root: str | Path, size: str, family: str = "qwen3", dtype: str | None = None) -> Path:
    """The random checkpoint (seed 0) of `family` at `size` kept under `root`, named by both and
    made only where it is not there yet: the benchmarks that measure one shape share its weights."""
    out_dir = Path(root) / (size if family == "qwen3" else f"{family}_{size}")
    if not (out_dir / CONFIG_FILE).is_file():
        make_tiny_checkpoint(out_dir, size=size, seed=0, dtype=dtype, family=family)
    return out_dir


def _write_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    added_tokens = {
        str(tokenizer.token_to_id(tok)): {"content": tok, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False, "special": True}
        for tok in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3")
    parser.add_argument("--size", default="tiny", help="tiny, small, or a real model's shape: "
                        + "; ".join(f"{family}: {', '.join(shapes)}" for family, shapes in REAL_SIZES.items()))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tie", action=argparse.BooleanOptionalAction, default=True,
                        help="tie lm_head to the input embedding (default: tied)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--weights", action=argparse.BooleanOptionalAction, default=True,
                        help="write the weights (--no-weights: config and tokenizer only, for vLLM's dummy weights)")
    args = parser.parse_args(argv)
    try:
        out = make_tiny_checkpoint(args.out_dir, args.size, args.seed, args.tie, args.dtype, args.family, args.weights)
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote {args.size} {args.family} checkpoint{'' if args.weights else ' (no weights)'} to {out}")


if __name__ == "__main__":
    main()
