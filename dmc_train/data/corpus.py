"""Reading raw corpora: text files, directories of them, and JSONL.

Formats
  text   one file = one document, read as UTF-8 (a leading BOM is dropped).
  jsonl  one line = one JSON object = one document; its text is the string field ``jsonl_key``
         (default ``"text"``); other fields are ignored; blank lines are ignored.
Files ending in ``.jsonl``/``.ndjson`` are JSONL, all others text (override with ``fmt``).
Directories are walked recursively (files sorted by relative path), hidden entries skipped, taking files whose
name ends with one of ``suffixes``. Explicit file arguments are taken whatever their suffix.

Bad input: empty files and empty (whitespace-only) documents are skipped and counted; undecodable
bytes become U+FFFD and are counted; a JSONL line that is not JSON, not an object, or lacks a string
``jsonl_key`` is a *bad line*, reported as ``file:line: reason`` and skipped or fatal (``on_bad_line``).

Work is cut into batches (a few whole text files, or up to ``JSONL_BATCH_LINES`` lines of one JSONL
file) that worker processes parse independently; batches keep input order, so the output does not
depend on the number of workers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from dmc_train.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
DEFAULT_SUFFIXES = (".txt", ".jsonl", ".ndjson")
TEXT_BATCH_FILES = 64
BATCH_BYTES = 1 << 20
JSONL_BATCH_LINES = 2048
MAX_EXAMPLES = 10  # bad lines kept verbatim for the report
ON_BAD_LINE = ("skip", "fail")


@dataclass(frozen=True)
class InputFile:
    path: str
    fmt: str  # "text" | "jsonl"
    size: int
    mtime_ns: int


@dataclass
class Batch:
    """A unit of work: whole text files, or consecutive lines of one JSONL file."""

    files: list[InputFile]
    first_line: int = 0  # JSONL: 1-based number of lines[0]
    lines: list[bytes] | None = None
    nbytes: int = 0


@dataclass
class ReadStats:
    files: int = 0
    documents: int = 0  # documents kept
    empty_files: int = 0
    empty_documents: int = 0
    bad_lines: int = 0
    replaced_bytes: int = 0  # undecodable byte sequences replaced by U+FFFD
    documents_with_replacements: int = 0
    bad_line_examples: list[str] = field(default_factory=list)

    def merge(self, other: ReadStats) -> None:
        for name in ("files", "documents", "empty_files", "empty_documents", "bad_lines", "replaced_bytes",
                     "documents_with_replacements"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.bad_line_examples.extend(other.bad_line_examples[:MAX_EXAMPLES - len(self.bad_line_examples)])

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def report(self) -> str:
        """One line: what was skipped or repaired ('' when nothing was)."""
        parts = []
        if self.empty_files:
            parts.append(f"{self.empty_files} empty file(s) skipped")
        if self.empty_documents:
            parts.append(f"{self.empty_documents} empty document(s) skipped")
        if self.bad_lines:
            parts.append(f"{self.bad_lines} bad JSONL line(s) skipped (first: {self.bad_line_examples[0]})")
        if self.replaced_bytes:
            parts.append(f"{self.replaced_bytes} undecodable byte sequence(s) replaced by U+FFFD in "
                         f"{self.documents_with_replacements} document(s)")
        return "; ".join(parts)


def expand_inputs(paths: list[str], fmt: str = "auto", suffixes: tuple[str, ...] = DEFAULT_SUFFIXES) -> list[InputFile]:
    """Input files in processing order; a missing path or an empty selection fails at once."""
    if fmt not in ("auto", "text", "jsonl"):
        raise DataError(f"input format must be one of auto, text, jsonl (got {fmt!r})")
    if not paths:
        raise DataError("no input paths given")
    out, seen = [], set()
    for p in paths:
        if not os.path.exists(p):
            raise DataError(f"input not found: {p}")
        if os.path.isdir(p):
            found = _walk(p, suffixes)
            if not found:
                raise DataError(f"no input files ending in {', '.join(suffixes)} under {p}")
        else:
            found = [p]
        for f in found:
            real = os.path.realpath(f)
            if real in seen:
                continue
            seen.add(real)
            st = os.stat(f)
            kind = fmt if fmt != "auto" else ("jsonl" if f.lower().endswith(JSONL_SUFFIXES) else "text")
            out.append(InputFile(os.path.abspath(f), kind, st.st_size, st.st_mtime_ns))
    return out


def _walk(root: str, suffixes: tuple[str, ...]) -> list[str]:
    """Matching files under ``root``, sorted by their path components relative to ``root``."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith(".") and name.lower().endswith(tuple(s.lower() for s in suffixes)):
                found.append(os.path.join(dirpath, name))
    return sorted(found, key=lambda f: os.path.relpath(f, root).split(os.sep))


def fingerprint(files: list[InputFile]) -> list[list]:
    """What identifies the inputs for up-to-date checks (path, size, mtime; contents are not read)."""
    return [[f.path, f.fmt, f.size, f.mtime_ns] for f in files]


def batches(files: list[InputFile]):
    """Yield ``Batch``es in input order (JSONL files are read here line by line, not parsed)."""
    pending: list[InputFile] = []
    pending_bytes = 0
    for f in files:
        if f.fmt == "text":
            pending.append(f)
            pending_bytes += f.size
            if len(pending) >= TEXT_BATCH_FILES or pending_bytes >= BATCH_BYTES:
                yield Batch(pending, nbytes=pending_bytes)
                pending, pending_bytes = [], 0
            continue
        if pending:
            yield Batch(pending, nbytes=pending_bytes)
            pending, pending_bytes = [], 0
        if f.size == 0:
            yield Batch([f], first_line=1, lines=[], nbytes=0)
            continue
        with open(f.path, "rb") as fh:
            lines, first, nbytes = [], 1, 0
            for i, line in enumerate(fh, start=1):
                lines.append(line)
                nbytes += len(line)
                if len(lines) >= JSONL_BATCH_LINES or nbytes >= BATCH_BYTES:
                    yield Batch([f], first_line=first, lines=lines, nbytes=nbytes)
                    lines, first, nbytes = [], i + 1, 0
            if lines:
                yield Batch([f], first_line=first, lines=lines, nbytes=nbytes)
    if pending:
        yield Batch(pending, nbytes=pending_bytes)


def parse_batch(batch: Batch, jsonl_key: str = "text") -> tuple[list[str], ReadStats, list[tuple[str, int, str]]]:
    """Documents of a batch, with its statistics and its bad lines ``(path, line number, reason)``."""
    stats, docs, bad = ReadStats(), [], []
    if batch.lines is None:
        for f in batch.files:
            stats.files += 1
            with open(f.path, "rb") as fh:
                raw = fh.read()
            text = _decode(raw, stats).removeprefix("\ufeff")
            if not text.strip():
                stats.empty_files += 1
                continue
            docs.append(text)
        stats.documents = len(docs)
        return docs, stats, bad

    f = batch.files[0]
    if batch.first_line == 1:
        stats.files += 1
        if f.size == 0:
            stats.empty_files += 1
    for lineno, raw in enumerate(batch.lines, start=batch.first_line):
        if not raw.strip():
            continue
        line = _decode(raw, stats)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            bad.append((f.path, lineno, f"invalid JSON ({e.msg})"))
            continue
        if not isinstance(obj, dict) or jsonl_key not in obj:
            bad.append((f.path, lineno, f"no {jsonl_key!r} field"))
            continue
        text = obj[jsonl_key]
        if not isinstance(text, str):
            bad.append((f.path, lineno, f"field {jsonl_key!r} is {type(text).__name__}, not a string"))
            continue
        if not text.strip():
            stats.empty_documents += 1
            continue
        docs.append(text)
    stats.documents = len(docs)
    stats.bad_lines = len(bad)
    stats.bad_line_examples = [f"{p}:{n}: {r}" for p, n, r in bad[:MAX_EXAMPLES]]
    return docs, stats, bad


def check_on_bad_line(on_bad_line: str) -> None:
    if on_bad_line not in ON_BAD_LINE:
        raise DataError(f"on_bad_line must be one of {', '.join(ON_BAD_LINE)} (got {on_bad_line!r})")


def check_bad_lines(bad: list[tuple[str, int, str]], on_bad_line: str) -> None:
    """Raise for the first bad line when ``on_bad_line == "fail"``."""
    check_on_bad_line(on_bad_line)
    if bad and on_bad_line == "fail":
        path, lineno, reason = bad[0]
        raise DataError(f"{path}:{lineno}: {reason} (fix the line, or pass --on-bad-line skip to skip such lines)")


def iter_documents(files: list[InputFile], jsonl_key: str = "text", on_bad_line: str = "fail"):
    """All documents in order, in this process (used to train the tokenizer)."""
    for batch in batches(files):
        docs, _, bad = parse_batch(batch, jsonl_key)
        check_bad_lines(bad, on_bad_line)
        yield from docs


def _decode(raw: bytes, stats: ReadStats) -> str:
    text = raw.decode("utf-8", errors="replace")
    # U+FFFD already present in the input is encoded as EF BF BD; the rest are replacements.
    replaced = text.count("\ufffd") - raw.count(b"\xef\xbf\xbd")
    if replaced:
        stats.replaced_bytes += replaced
        stats.documents_with_replacements += 1
    return text
