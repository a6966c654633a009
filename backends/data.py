"""Prompt datasets from files: JSONL, parquet or a saved ``datasets`` dir, checked and tokenised up front.

A row holds a prompt (``data.prompt_key``: a string, or a chat in verl's format
``[{"role": "user", "content": ...}, ...]``), a ground truth (``data.answer_key``; a dotted key such as
``reward_model.ground_truth`` reads verl's nested column) and any other columns, which reach the reward
function as keyword arguments. ``data_source`` (``data.source_key``) names the row's source, which routes
rewards and splits evaluation metrics.

:func:`load_examples` reads every file, checks every row and tokenises every prompt before any training:
a file that does not parse, a row without the prompt or the answer (or with a null answer), a message without a
role, or a prompt longer than ``data.max_prompt_length`` under ``truncation=error`` is a :class:`DataError` that
names the file and the row. A prompt's bytes are checked before it is tokenised (:func:`prompt_byte_limit`), so a
huge row is refused without building gigabytes of tokens. Chat prompts go through
``tokenizer.apply_chat_template`` (with the generation prompt); string prompts are tokenised as they are.

:class:`PromptStream` serves the examples in a seeded order, reshuffled every epoch; its position is one
integer (``drawn``), which checkpoints record for exact resume.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, Sequence

import attrs

__all__ = [
    "CHAT_ROLES",
    "DataConfig",
    "DataError",
    "Example",
    "LoadReport",
    "PromptStream",
    "TRUNCATION_BYTES_FACTOR",
    "column_value",
    "data_warnings",
    "load_examples",
    "max_token_bytes",
    "prompt_byte_limit",
    "prompt_token_ids",
    "read_rows",
]

#: data.truncation=left / right tokenises a whole prompt to cut it: prompts up to this many times the bytes that
#: data.max_prompt_length tokens can spell are cut, longer ones are refused (tokenising megabytes of text takes
#: gigabytes of memory)
TRUNCATION_BYTES_FACTOR = 64

#: the message roles a chat prompt may hold
CHAT_ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file and the row."""


@attrs.frozen
class DataConfig:
    """Where the prompts come from and how they become token ids."""

    #: training data: .jsonl / .json (one object per line), .parquet, or a saved datasets dir
    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()  #: held-out data for evaluation (same format); empty: no evaluation
    prompt_key: str = "prompt"  #: column holding the prompt: a string or a list of {role, content} messages
    #: column of the ground truth given to the reward (dotted for nested: reward_model.ground_truth); empty: none
    answer_key: str = "answer"
    #: column naming the row's source (routes rewards, splits eval metrics); rows without it: "default"
    source_key: str = "data_source"
    #: longest prompt in tokens, after the chat template
    max_prompt_length: int = attrs.field(default=512, validator=attrs.validators.ge(1))
    #: what a longer prompt does: error (stop, naming the row), left / right (keep the last / first
    #: max_prompt_length tokens), filter (drop the row and count it)
    truncation: Literal["error", "left", "right", "filter"] = "error"
    shuffle: bool = True  #: reshuffle the training rows every epoch (seeded by the run's seed)
    #: auto: chat prompts through the tokenizer's chat template; none: no template (chat prompts are an
    #: error); a path: that Jinja template file instead of the tokenizer's
    chat_template: str = "auto"


@attrs.frozen(eq=False)
class Example:
    """One prompt, ready to sample from: its token ids, ground truth and the row's other columns."""

    prompt_ids: tuple[int, ...]
    ground_truth: Any  #: the answer_key value (None without an answer_key)
    source: str  #: the data_source column ("default" when the row has none)
    columns: Mapping[str, Any]  #: every column but the prompt and the answer (data_source included)
    where: str  #: file and row, for messages: "train.jsonl:line 3" / "data.parquet[row 2]"
    prompt: Any = None  #: the prompt as the row gives it (a string or chat messages): what an agent reads


@attrs.frozen
class LoadReport:
    """What :func:`load_examples` did with the rows."""

    rows: int  #: rows read
    kept: int  #: examples returned
    filtered: int  #: rows dropped by truncation=filter
    truncated: int  #: prompts cut by truncation=left / right
    empty_contents: int = 0  #: rows with a chat message whose content is ""
    first_empty_content: str = ""  #: the first of them ("train.jsonl:line 3 prompt[1]")


# ------------------------------------------------------------------------------------------ reading


def read_rows(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` for every row of a JSONL / JSON-lines, parquet or saved-``datasets`` file or dir."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if path.is_dir():
        yield from _dataset_dir_rows(path)
    elif path.suffix in (".jsonl", ".json"):
        yield from _jsonl_rows(path)
    elif path.suffix == ".parquet":
        yield from _parquet_rows(path)
    else:
        raise DataError(f"{path}: unknown data format {path.suffix!r} (use .jsonl, .parquet or a saved datasets dir)")


_ARRAY_HINT = (
    "; the file looks like one JSON array, and data files are JSON Lines: one JSON object per line "
    '(convert it with: python -c "import json,sys; [print(json.dumps(r)) for r in json.load(sys.stdin)]" '
    "< in.json > out.jsonl)"
)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}:line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of the line)") from None
            if not line.strip():
                continue
            # a file holding one JSON array (not JSON Lines) shows itself on its first line
            array = _ARRAY_HINT if number == 1 and line.lstrip().startswith("[") else ""
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}){array}") from None
            except RecursionError:  # the parser's own limit: name the row rather than crash
                raise DataError(
                    f"{where}: the JSON is nested too deeply to read (more than Python's recursion limit, "
                    f"{sys.getrecursionlimit()} levels)"
                ) from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}{array}")
            yield where, row


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a damaged or foreign file
        raise DataError(f"{path}: cannot read as parquet ({type(e).__name__}: {e})") from None
    for index, row in enumerate(table.to_pylist()):
        yield f"{path}[row {index}]", row


def _dataset_dir_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataError(f"{path}: not a dataset saved with datasets' save_to_disk ({type(e).__name__}: {e})") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = ", ".join(f"{path / s}" for s in loaded)
        raise DataError(f"{path}: a DatasetDict with splits {list(loaded)}; give one split's dir: {splits}")
    for index, row in enumerate(loaded):
        yield f"{path}[row {index}]", row


# ------------------------------------------------------------------------------------------- checks


def column_value(row: Mapping[str, Any], key: str, where: str) -> Any:
    """``row[key]``, following dots into nested mappings; a missing column names what the row has."""
    value: Any = row
    for i, part in enumerate(key.split(".")):
        if not isinstance(value, Mapping) or part not in value:
            at = ".".join(key.split(".")[:i]) or "the row"
            have = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            raise DataError(f"{where}: no column {key!r} ({at} has {have})")
        value = value[part]
    return value


def _check_prompt(prompt: Any, where: str, key: str) -> str | list[dict[str, str]]:
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{where}: {key} is an empty string")
        return prompt
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise DataError(f"{where}: {key} must be a string or a non-empty list of messages, got {type(prompt).__name__}")
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise DataError(
                f"{where}: {key}[{i}] must be a {{'role': ..., 'content': ...}} message, got {message!r:.80}"
            )
        if message["role"] not in CHAT_ROLES:
            raise DataError(f"{where}: {key}[{i}] has role {message['role']!r}; known roles: {', '.join(CHAT_ROLES)}")
        if not isinstance(message["content"], str):
            raise DataError(f"{where}: {key}[{i}].content must be a string, got {type(message['content']).__name__}")
        messages.append(dict(message))
    return messages


def _empty_content(prompt: str | list[dict[str, str]], key: str) -> str:
    """Where a chat prompt first has a message with empty content (``prompt[1]``), or ""."""
    if isinstance(prompt, str):
        return ""
    return next((f"{key}[{i}]" for i, m in enumerate(prompt) if not m["content"]), "")


def _prompt_bytes(prompt: str | list[dict[str, str]]) -> int:
    """The UTF-8 bytes of a prompt's text (every message's content for a chat)."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8"))
    return sum(len(m["content"].encode("utf-8")) for m in prompt)


def max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes of text one token of ``tokenizer`` can stand for, bounded from above by the longest
    token string of its vocabulary in UTF-8 (a byte-level BPE token spells each byte with one character of one or
    two bytes; a SentencePiece piece spells a space with the 3-byte ``▁``), at least 4 (an unknown character)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max([4, *(len(token.encode("utf-8")) for token in vocab)])


def prompt_byte_limit(cfg: DataConfig, per_token: int) -> int:
    """The most bytes of prompt text a row may have under ``cfg``, checked before tokenising: a prompt of more bytes
    than ``cfg.max_prompt_length`` tokens of ``per_token`` bytes can spell has more tokens than that, so it is
    refused (truncation=error) or filtered without tokenising; truncation=left / right tokenise prompts up to
    :data:`TRUNCATION_BYTES_FACTOR` times that long to cut them."""
    limit = cfg.max_prompt_length * per_token
    return limit * TRUNCATION_BYTES_FACTOR if cfg.truncation in ("left", "right") else limit


def _refuse_by_bytes(nbytes: int, cfg: DataConfig, per_token: int, where: str) -> bool:
    """Whether a prompt of ``nbytes`` is filtered out before tokenising (truncation=filter); an error under the other
    modes. False: it is within :func:`prompt_byte_limit` and gets tokenised."""
    limit = prompt_byte_limit(cfg, per_token)
    if nbytes <= limit:
        return False
    if cfg.truncation == "filter":
        return True
    spell = f"data.max_prompt_length={cfg.max_prompt_length} tokens of at most {per_token} bytes each"
    if cfg.truncation == "error":
        raise DataError(
            f"{where}: the prompt is {nbytes:,} bytes of text, more than {spell} can hold ({limit:,} "
            "bytes): refused before tokenising (raise data.max_prompt_length, or set "
            "data.truncation=left|right|filter)"
        )
    raise DataError(
        f"{where}: the prompt is {nbytes:,} bytes of text; data.truncation={cfg.truncation} cuts prompts "
        f"up to {TRUNCATION_BYTES_FACTOR} x what {spell} can hold ({limit:,} bytes): refused before "
        "tokenising (shorten it in the data, or set data.truncation=filter to drop such rows)"
    )


def prompt_token_ids(
    prompt: str | Sequence[Mapping[str, str]],
    tokenizer: Any,
    *,
    chat_template: str = "auto",
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """The token ids the model reads for ``prompt``: a chat through the chat template with the
    generation prompt (``apply_chat_template``'s ids exactly, with the JSON schemas of ``tools`` when a
    multi-turn run has tools), a string as the tokenizer encodes it."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if chat_template == "none":
        raise DataError("a chat prompt needs a chat template, and data.chat_template=none")
    template = None if chat_template == "auto" else Path(chat_template).read_text()
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "the tokenizer has no chat template for chat prompts; give one with data.chat_template=<jinja file>"
        )
    try:
        encoded = tokenizer.apply_chat_template(
            list(prompt),
            add_generation_prompt=True,
            tokenize=True,
            chat_template=template,
            tools=list(tools) if tools else None,
        )
    except Exception as e:  # a broken template: jinja's errors name neither the template nor the row
        source = "the tokenizer's chat template" if template is None else f"the chat template {chat_template}"
        raise DataError(f"{source} failed on this prompt: {type(e).__name__}: {e}") from e
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


def _fit_length(ids: list[int], cfg: DataConfig, where: str) -> list[int] | None:
    """``ids`` within ``cfg.max_prompt_length`` by ``cfg.truncation`` (``None``: filtered out)."""
    if len(ids) <= cfg.max_prompt_length:
        return ids
    if cfg.truncation == "error":
        raise DataError(
            f"{where}: the prompt has {len(ids)} tokens, more than data.max_prompt_length={cfg.max_prompt_length} "
            "(raise it, or set data.truncation=left|right|filter)"
        )
    if cfg.truncation == "filter":
        return None
    return ids[-cfg.max_prompt_length :] if cfg.truncation == "left" else ids[: cfg.max_prompt_length]


def load_examples(
    files: Sequence[str], cfg: DataConfig, tokenizer: Any, *, tools: Sequence[Mapping[str, Any]] | None = None
) -> tuple[list[Example], LoadReport]:
    """Every row of ``files`` (in order) as an :class:`Example`, checked and tokenised (chat prompts with the
    ``tools`` schemas); see the module doc."""
    if isinstance(files, str):
        files = (files,)
    if cfg.chat_template not in ("auto", "none") and not Path(cfg.chat_template).is_file():
        raise DataError(f"data.chat_template={cfg.chat_template!r}: no such template file (or use auto / none)")
    examples: list[Example] = []
    rows = filtered = truncated = empty = 0
    first_empty, per_token = "", max_token_bytes(tokenizer)
    for path in files:
        for where, row in read_rows(path):
            rows += 1
            prompt = _check_prompt(column_value(row, cfg.prompt_key, where), where, cfg.prompt_key)
            answer = column_value(row, cfg.answer_key, where) if cfg.answer_key else None
            if cfg.answer_key and answer is None:
                raise DataError(
                    f"{where}: {cfg.answer_key} is null; the reward gets each row's ground truth (give "
                    "every row one, or set data.answer_key= (empty) for a reward that needs none)"
                )
            if blank := _empty_content(prompt, cfg.prompt_key):
                empty, first_empty = empty + 1, first_empty or f"{where} {blank}"
            if _refuse_by_bytes(_prompt_bytes(prompt), cfg, per_token, where):
                filtered += 1
                continue
            try:
                ids = prompt_token_ids(prompt, tokenizer, chat_template=cfg.chat_template, tools=tools)
            except DataError as e:
                raise DataError(f"{where}: {e}") from None
            fitted = _fit_length(ids, cfg, where)
            if fitted is None:
                filtered += 1
                continue
            truncated += len(fitted) < len(ids)
            top_answer = cfg.answer_key if "." not in cfg.answer_key else None  # a nested answer's column stays
            columns = {k: v for k, v in row.items() if k not in (cfg.prompt_key, top_answer)}
            source = row.get(cfg.source_key)
            examples.append(
                Example(
                    prompt_ids=tuple(fitted),
                    ground_truth=answer,
                    source=str(source) if source not in (None, "") else "default",
                    columns=columns,
                    where=where,
                    prompt=prompt,
                )
            )
    if rows == 0:
        raise DataError(f"no rows in {', '.join(map(str, files)) or 'the data files (none given)'}")
    if not examples:
        raise DataError(
            f"all {rows} rows of {', '.join(map(str, files))} are longer than data.max_prompt_length="
            f"{cfg.max_prompt_length} and were filtered out"
        )
    return examples, LoadReport(
        rows=rows,
        kept=len(examples),
        filtered=filtered,
        truncated=truncated,
        empty_contents=empty,
        first_empty_content=first_empty,
    )


def data_warnings(
    train_files: Sequence[str], val_files: Sequence[str], reports: Mapping[str, LoadReport], *, prompts_per_step: int
) -> list[str]:
    """What is allowed but probably not meant, one line each, for a run to warn about once: held-out files that are
    training files (the evaluation measures memory, not learning), chat messages with empty content, and fewer
    training prompts than one step draws (every step repeats prompts). ``reports``: ``{"training": ..., "held-out":
    ...}`` of :func:`load_examples`."""
    warnings = []
    same = sorted({str(Path(f).resolve()) for f in train_files} & {str(Path(f).resolve()) for f in val_files})
    if same:
        warnings.append(
            f"the held-out data is training data ({', '.join(same)} in both data.train_files and the "
            "held-out files): the evaluation measures what the policy memorised, not what it learned"
        )
    for name, report in reports.items():
        if report.empty_contents:
            warnings.append(
                f"{report.empty_contents} {name} row(s) have a chat message with empty content (the first: "
                f"{report.first_empty_content}); the model reads only the template's markers there"
            )
    train = reports.get("training")
    if train is not None and train.kept < prompts_per_step:
        warnings.append(
            f"the training data has {train.kept} prompt(s), fewer than prompts_per_step="
            f"{prompts_per_step}: every step draws some prompts more than once"
        )
    return warnings


# ------------------------------------------------------------------------------------------- stream


class PromptStream:
    """The examples in a seeded order, epoch after epoch (reshuffled each epoch when ``shuffle``).

    The position is ``drawn`` (examples taken so far): ``PromptStream(examples, seed=s, drawn=d)`` continues
    exactly where a stream with the same examples and seed stood after ``d`` draws.
    """

    def __init__(self, examples: Sequence[Example], *, seed: int, shuffle: bool = True, drawn: int = 0) -> None:
        if not examples:
            raise DataError("a prompt stream needs at least one example")
        if drawn < 0:
            raise ValueError(f"drawn must be >= 0, got {drawn}")
        self.examples = list(examples)
        self.seed = seed
        self.shuffle = shuffle
        self.drawn = drawn
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def epoch(self) -> int:
        """The epoch the next example comes from (0-based)."""
        return self.drawn // len(self.examples)

    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(len(self.examples)))
            if self.shuffle:
                random.Random(f"prompt-stream-{self.seed}-{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def take(self, n: int) -> list[Example]:
        """The next ``n`` examples (crossing into the next epoch when this one runs out)."""
        out = []
        for _ in range(n):
            epoch, index = divmod(self.drawn, len(self.examples))
            out.append(self.examples[self._order_of(epoch)[index]])
            self.drawn += 1
        return out

    def steps_per_epoch(self, per_step: int) -> int:
        """Steps of ``per_step`` examples that one epoch gives (the last one may cross into the next)."""
        return math.ceil(len(self.examples) / per_step)
