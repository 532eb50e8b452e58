"""Chat templates for checkpoints whose tokenizer ships none.

SDAR checkpoints carry their Qwen3 template in the tokenizer; LLaDA2.x uses the Bailing role format
(``<role>SYSTEM</role>...<|role_end|><role>HUMAN</role>...<|role_end|><role>ASSISTANT</role>``), written here
so a tokenizer without ``chat_template`` still formats chats the way the model was trained. Without a system
message the system turn is ``detailed thinking off``, as in the published LLaDA2 examples.

Each model family names its template (:attr:`dllm_jax.model.family.ModelFamily.chat_template`;
:func:`dllm_jax.model.family.default_chat_template` gives a config's).
"""

from __future__ import annotations

LLADA2_DEFAULT_SYSTEM = "detailed thinking off"

LLADA2_CHAT_TEMPLATE = (
    "{%- set role_tags = {'system': 'SYSTEM', 'user': 'HUMAN', 'human': 'HUMAN', 'assistant': 'ASSISTANT'} -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- '<role>SYSTEM</role>' + messages[0]['content'] + '<|role_end|>' -}}"
    "{%- set rest = messages[1:] -%}"
    "{%- else -%}"
    "{{- '<role>SYSTEM</role>" + LLADA2_DEFAULT_SYSTEM + "<|role_end|>' -}}"
    "{%- set rest = messages -%}"
    "{%- endif -%}"
    "{%- for message in rest -%}"
    "{{- '<role>' + role_tags.get(message['role'], message['role'] | upper) + '</role>'"
    " + message['content'] + '<|role_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<role>ASSISTANT</role>' -}}{%- endif -%}"
)


def render_llada2_chat(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Plain-Python rendering of :data:`LLADA2_CHAT_TEMPLATE` (for tokenizer-less callers and tests)."""
    tags = {"system": "SYSTEM", "user": "HUMAN", "human": "HUMAN", "assistant": "ASSISTANT"}
    if messages and messages[0]["role"] == "system":
        out, rest = f"<role>SYSTEM</role>{messages[0]['content']}<|role_end|>", messages[1:]
    else:
        out, rest = f"<role>SYSTEM</role>{LLADA2_DEFAULT_SYSTEM}<|role_end|>", messages
    for m in rest:
        out += f"<role>{tags.get(m['role'], m['role'].upper())}</role>{m['content']}<|role_end|>"
    return out + ("<role>ASSISTANT</role>" if add_generation_prompt else "")


# Gemma's turn format (``<start_of_turn>user ... <end_of_turn>``, the assistant's role named ``model``): used for a
# DiffusionGemma checkpoint whose tokenizer ships no template (the published one ships its own, which wins).
GEMMA_CHAT_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
{%- set role = 'model' if message.role == 'assistant' else message.role %}
{{- '<start_of_turn>' + role + '\\n' + (message.content if message.content is string else '') | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}
"""
