"""A GGUF file's own chat template (``tokenizer.chat_template``) applied to a prompt, as HF transformers renders one:
jinja2 in its immutable sandbox, ``trim_blocks`` and ``lstrip_blocks``, the conversation as ``messages``, the
generation prompt asked for, the file's BOS and EOS tokens as ``bos_token`` and ``eos_token``.

The template comes from a file, so it is bounded: its length, the text it renders, the values it builds, the steps of
its loops, and what it may reach (the sandbox refuses attribute access outside plain data). A template that writes the
BOS token itself has it taken off the front of the text: the first stage puts the BOS before the prompt's tokens, once.
"""

from __future__ import annotations

import datetime
from typing import Any

from ppharness.errors import ModelError

MAX_TEMPLATE = 1 << 16  # characters of a template (real ones are a few thousand)
MAX_RENDERED = 1 << 20  # characters of the text it renders, and items of any value it builds
MAX_STEPS = 100_000  # steps of all its loops over range() together


def _token(kv: dict[str, Any], key: str) -> str:
    tokens = kv.get("tokenizer.ggml.tokens")
    at = kv.get(key)
    if tokens is None or not isinstance(at, int) or not 0 <= at < len(tokens):
        return ""
    return str(tokens[at])


def _environment(source: str) -> Any:
    """jinja2's immutable sandbox as HF renders chat templates, with the work a template can ask for bounded: loops
    over ``range`` take at most ``MAX_STEPS`` steps in all, and ``*`` and ``**`` never build a value longer than
    ``MAX_RENDERED`` (jinja2 itself bounds neither a loop inside a loop nor a product)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    steps = [0]

    def bounded_range(*args: int) -> range:
        r = range(*args)
        steps[0] += len(r)
        if steps[0] > MAX_STEPS:
            raise ModelError(f"{source}: its chat template loops more than {MAX_STEPS:,} times")
        return r

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**":
                raise ModelError(f"{source}: its chat template raises to a power, which no chat template needs")
            if isinstance(left, int) and isinstance(right, (str, list, tuple)):
                left, right = right, left
            if isinstance(left, (str, list, tuple)) and isinstance(right, int) and len(left) * right > MAX_RENDERED:
                raise ModelError(f"{source}: its chat template builds a value of more than {MAX_RENDERED:,} items")
            return super().call_binop(context, operator, left, right)

    env = Bounded(trim_blocks=True, lstrip_blocks=True)
    env.globals["range"] = bounded_range
    return env


def chat_prompt(kv: dict[str, Any], prompt: str, system: str | None = None, source: str = "the model") -> str:
    """``prompt`` as one user turn (after ``system``'s, when given) in the chat template of the file whose metadata is
    ``kv``, ready for the assistant's answer; ``ModelError`` when the file has none or it does not render."""
    from jinja2 import TemplateError

    template = kv.get("tokenizer.chat_template")
    if not isinstance(template, str) or not template.strip():
        raise ModelError(
            f"{source} has no chat template (tokenizer.chat_template): leave out --chat and write the prompt in the "
            "form the model expects"
        )
    if len(template) > MAX_TEMPLATE:
        raise ModelError(f"{source}: its chat template has {len(template):,} characters, more than {MAX_TEMPLATE:,}")

    def raise_exception(message: str) -> None:
        raise ModelError(f"{source}: its chat template refused the conversation: {message}")

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = _environment(source)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": prompt}
    ]
    bos = _token(kv, "tokenizer.ggml.bos_token_id")
    eos = _token(kv, "tokenizer.ggml.eos_token_id")
    parts: list[str] = []
    length = 0
    try:
        for part in env.from_string(template).generate(
            messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos
        ):
            length += len(part)
            if length > MAX_RENDERED:
                raise ModelError(f"{source}: its chat template rendered more than {MAX_RENDERED:,} characters")
            parts.append(part)
    except TemplateError as exc:
        raise ModelError(f"{source}: its chat template does not render: {exc}") from None
    text = "".join(parts)
    adds_bos = kv.get("tokenizer.ggml.add_bos_token", True) and "tokenizer.ggml.bos_token_id" in kv
    if bos and adds_bos and text.startswith(bos):
        text = text[len(bos) :]
    return text
