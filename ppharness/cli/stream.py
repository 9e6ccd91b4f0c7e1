"""The answer on the terminal as it is generated: each token the orchestrator receives, decoded with the model's own
tokenizer and printed after the text before it."""

from __future__ import annotations

from collections.abc import Callable

import click

from ppharness.model.gguf_file import GGUFFile

REPLACEMENT = "\ufffd"  # what decoding makes of a UTF-8 sequence whose last bytes have not come yet


class AnswerStream:
    """``start(model_path)`` returns the function that is told the answer's token ids so far (the first call prints
    the ``answer:`` line's head); ``end()`` ends the line. Text is printed once it is final: an end-of-generation token
    ends the answer, and a character whose bytes are split across tokens waits for its last one."""

    def __init__(self, err: bool = False) -> None:
        self.err = err
        self.printed = ""
        self.started = False

    def start(self, model_path: str) -> Callable[[list[int]], None]:
        f = GGUFFile(model_path)
        tokenizer, eog = f.tokenizer, set(f.config.eog_ids)

        def show(ids: list[int]) -> None:
            if not self.started:
                click.echo("answer: ", nl=False, err=self.err)
                self.started = True
            end = next((i for i, t in enumerate(ids) if t in eog), len(ids))
            text = tokenizer.decode(ids[:end], cleanup=False)  # as llama.cpp prints tokens as they come
            final = text if end < len(ids) else text.rstrip(REPLACEMENT)
            if final.startswith(self.printed) and len(final) > len(self.printed):
                click.echo(final[len(self.printed) :], nl=False, err=self.err)
                self.printed = final

        return show

    def end(self) -> None:
        if self.started:
            click.echo("", err=self.err)
            self.started = False
