"""Tokenizer files as the published checkpoints ship them, for test fixtures: a small Qwen2-style byte-level BPE
(trained offline in milliseconds), saved as SDAR's ``vocab.json`` + ``merges.txt`` + ``tokenizer_config.json`` +
``added_tokens.json`` + ``chat_template.jinja``, or as LLaDA2's ``tokenizer.json`` with the template inside."""

from __future__ import annotations

import json
import os

import numpy as np

SDAR_MASK_TOKEN = "<|MASK|>"
LLADA2_MASK_TOKEN = "<|mask|>"

# Qwen2's pre-tokenizer split (the regex its tokenizer.json carries).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")

# Added tokens in Qwen3's order (their ids follow the BPE vocabulary); SDAR appends <|MASK|>.
QWEN3_ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False), (SDAR_MASK_TOKEN, True),
)
GEMMA_ADDED_TOKENS = (("<pad>", True), ("<eos>", True), ("<bos>", True), ("<start_of_turn>", True),
                      ("<end_of_turn>", True))
LLADA2_ADDED_TOKENS = (("<|endoftext|>", True), ("<role>", True), ("</role>", True), ("<|role_end|>", True),
                       ("<think>", False), ("</think>", False), (LLADA2_MASK_TOKEN, True))

_CORPUS_WORDS = ("the a an of to in is was and for on with as by at from that this it be are or not you we they "
                 "hello world count number one two three four five six seven eight nine ten answer question "
                 "please tell me story about weather today tomorrow city river mountain apple banana cherry "
                 "function call tool result system user assistant think reason step first then finally "
                 "python code json list dict value key name time date good bad yes no why how what where").split()


MAX_BPE_VOCAB = 1 << 16


def train_bpe(vocab_size: int, seed: int = 0):
    """A byte-level BPE with Qwen2's pre-tokenizer and exactly ``vocab_size`` tokens (256 bytes and the merges),
    trained offline in milliseconds on a synthetic corpus. The corpus of words above has merges for about 540
    tokens; a larger vocabulary is trained on it plus seeded pseudo-words (random letter strings, as many as it
    takes), so that the tokens of every size up to that stay those of the word corpus alone."""
    if not isinstance(vocab_size, int) or not 256 <= vocab_size <= MAX_BPE_VOCAB:
        raise ValueError(f"bpe_vocab: must be an integer in [256, {MAX_BPE_VOCAB}] (a byte-level BPE holds the 256 "
                         f"bytes, then its merges), got {vocab_size!r}")
    rng = np.random.default_rng(seed)
    corpus = []
    for _ in range(2000):
        words = rng.choice(_CORPUS_WORDS, size=int(rng.integers(4, 16)))
        corpus.append(" ".join(words) + (". " if rng.random() < 0.5 else ", ") + str(int(rng.integers(0, 1000))))
    tok = _train_bpe(corpus, vocab_size)
    extra, words = np.random.default_rng([seed, 1]), 8000
    while tok.get_vocab_size() < vocab_size:
        lengths = extra.integers(2, 9, size=words)
        letters = (extra.integers(0, 26, size=int(lengths.sum())) + ord("a")).astype(np.uint8).tobytes().decode()
        ends = np.cumsum(lengths)
        pseudo = [letters[e - n:e] for e, n in zip(ends, lengths)]
        corpus += [" ".join(pseudo[i:i + 10]) for i in range(0, words, 10)]
        words *= 2
        tok = _train_bpe(corpus, vocab_size)
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def _train_bpe(corpus: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok


def write_qwen2_tokenizer(out_dir: str, *, bpe_vocab: int = 400, added=QWEN3_ADDED_TOKENS,
                          eos_token: str = "<|im_end|>", pad_token: str = "<|endoftext|>", remote_code: bool = True,
                          chat_template: str | None = None) -> dict[str, int]:
    """The Qwen2 tokenizer files SDAR ships: ``vocab.json``, ``merges.txt``, ``tokenizer_config.json``,
    ``added_tokens.json`` (no ``tokenizer.json``) and ``chat_template.jinja``. Returns the added tokens' ids."""
    tok = train_bpe(bpe_vocab)
    tok.model.save(out_dir)  # vocab.json + merges.txt
    base = tok.get_vocab_size()
    ids = {content: base + i for i, (content, _) in enumerate(added)}
    with open(os.path.join(out_dir, "added_tokens.json"), "w") as f:
        json.dump(ids, f, indent=2)
    decoder = {str(ids[c]): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": special} for c, special in added}
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [c for c, special in added if special and c not in (eos_token, pad_token)],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos_token,
        "errors": "replace",
        "extra_special_tokens": {},
        "model_max_length": 131072,
        "pad_token": pad_token,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if remote_code:
        cfg["auto_map"] = {"AutoTokenizer": ["tokenization_qwen2.Qwen2Tokenizer",
                                             "tokenization_qwen2_fast.Qwen2TokenizerFast"]}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(QWEN3_CHAT_TEMPLATE if chat_template is None else chat_template)
    return ids


def write_fast_tokenizer(out_dir: str, *, bpe_vocab: int = 400, added=LLADA2_ADDED_TOKENS,
                         eos_token: str = "<|endoftext|>", chat_template: str | None = None) -> dict[str, int]:
    """LLaDA2's tokenizer files: ``tokenizer.json`` and ``tokenizer_config.json`` (``PreTrainedTokenizerFast``,
    the chat template inside). Returns the added tokens' ids."""
    from tokenizers import AddedToken

    tok = train_bpe(bpe_vocab)
    base = tok.get_vocab_size()
    tok.add_tokens([AddedToken(c, special=s, normalized=False) for c, s in added])
    ids = {content: base + i for i, (content, _) in enumerate(added)}
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    from dllm_jax.model.templates import LLADA2_CHAT_TEMPLATE

    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "pad_token": eos_token,
           "mask_token": LLADA2_MASK_TOKEN, "clean_up_tokenization_spaces": False, "model_max_length": 32768,
           "chat_template": LLADA2_CHAT_TEMPLATE if chat_template is None else chat_template,
           "auto_map": {"AutoTokenizer": ["tokenization_bailing.BailingTokenizer", None]}}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return ids


# A Qwen3-style chat template (system prompt, tools, multi-turn, tool calls and responses, thinking blocks and
# ``enable_thinking``), written for these fixtures in the structure of the published one.
QWEN3_CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with \
function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n\
</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1, seen_query=false) %}
{%- for message in messages[::-1] %}
{%- set i = messages|length - 1 - loop.index0 %}
{%- if not ns.seen_query and message.role == 'user' and not (message.content is string and \
message.content.startswith('<tool_response>')) %}
{%- set ns.last_query = i %}{%- set ns.seen_query = true %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
{%- if not reasoning and '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>assistant\\n' }}
{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
{%- endif %}
{{- content }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function else call %}
{%- if loop.first and content %}{{- '\\n' }}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""


GEMMA_IMAGE_TOKENS = (("<|image|>", True), ("<|image>", True), ("<image|>", True))  # image, begin, end (Gemma 4)


def write_gemma_tokenizer(out_dir: str, *, bpe_vocab: int = 400, images: bool = False) -> dict[str, int]:
    """A Gemma-style fast tokenizer (``<bos>``, ``<eos>``, turn markers; Gemma's chat template): for tiny
    DiffusionGemma fixtures, whose ``vocab_size`` must then be ``bpe_vocab + len(GEMMA_ADDED_TOKENS)``. With
    ``images``, Gemma 4's image tokens last (three more ids: the tiny checkpoints' ``image_token_ids``)."""
    from tokenizers import AddedToken

    from dllm_jax.model.templates import GEMMA_CHAT_TEMPLATE

    tok = train_bpe(bpe_vocab)
    base = tok.get_vocab_size()
    added = GEMMA_ADDED_TOKENS + (GEMMA_IMAGE_TOKENS if images else ())
    tok.add_tokens([AddedToken(c, special=s, normalized=False) for c, s in added])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
           "pad_token": "<pad>", "clean_up_tokenization_spaces": False, "model_max_length": 131072,
           "chat_template": GEMMA_CHAT_TEMPLATE}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return {content: base + i for i, (content, _) in enumerate(added)}
