"""Chat templates for models that ship none (base models, bare GGUFs, synthetic checkpoints): gpt-oss's own harmony
template for gpt-oss, Gemma's turn markers for Gemma, ChatML for every other family."""

from __future__ import annotations

import functools
from importlib import resources

DEFAULT_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] if message['content'] is string else '')"
    " + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The template for models that ship none: ChatML, with the assistant header as generation prompt."""

DEFAULT_GEMMA = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = (messages[0]['content'] if messages[0]['content'] is string else '') + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\\n'"
    " + (first_user_prefix if loop.first else '') }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% endif %}"
    "{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
"""The template for Gemma models that ship none (base models): Gemma 3's instruct template, less its check that
roles alternate (every role but the assistant's is a user turn)."""

_GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3", "gemma3_text")
_GPT_OSS_FAMILIES = ("gpt_oss", "gpt-oss")  # config.json's model_type, GGUF's general.architecture


@functools.cache
def gpt_oss_template() -> str:
    """gpt-oss's own chat template (harmony), as released with the model (see models/templates/README.md)."""
    return (
        resources.files("waferscale.models").joinpath("templates/gpt-oss.jinja").read_text(encoding="utf-8")
    )


def default_chat_template(architecture: str) -> str:
    """The chat template for a model of `architecture` (a GGUF's general.architecture or a config's model_type)
    that ships none: gpt-oss's harmony template for gpt-oss (the model only works in harmony), Gemma's turn markers
    for Gemma, ChatML for every other family."""
    if architecture in _GPT_OSS_FAMILIES:
        return gpt_oss_template()
    return DEFAULT_GEMMA if architecture in _GEMMA_FAMILIES else DEFAULT_CHATML
