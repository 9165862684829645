"""Prompt generator "self": coding requests written by the target itself (self-instruct).

The v2 and answers generators fill templates, so every request of a kind reads alike, while users
write free-form requests: a pasted stack trace, a half-remembered API, a function with a question
about it. This generator asks the target to write such requests. A few-shot page of hand-written
example requests (``SEEDS``, none of them an evaluation prompt) is continued as raw text after a
header naming a language, a kind of request and a topic (drawn so that every pair appears), and
the target samples the next request. What comes back is cleaned (cut at the next header, an
unfinished code fence or an answer instead of a request is dropped), deduplicated and filtered
against every evaluation prompt (``runtime.train.dedupe``). The requests are then answered like
any other dataset's prompts, greedily, so the labels stay the target's own choices.

Kinds (``TrainPrompt.kind``): ``self-<task>`` for each task of ``TASKS``.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.train.generator import drop_evaluation_duplicates, merge_by_mix
from runtime.train.prompt_list import TrainPrompt
from runtime.train.prompts import LANGUAGES


@dataclass(frozen=True)
class Task:
    """One kind of request: its name in the header and whether the request pastes code."""

    key: str
    header: str
    code: bool


TASKS: tuple[Task, ...] = (
    Task("write", "write new code", False),
    Task("fix", "fix a bug, with the code pasted", True),
    Task("tests", "write tests for pasted code", True),
    Task("types", "add types to pasted code", True),
    Task("refactor", "refactor pasted code", True),
    Task("explain", "explain pasted code", True),
    Task("concept", "explain a concept with an example", False),
    Task("port", "port pasted code to another language", True),
    Task("error", "an error message and what causes it", True),
    Task("design", "design a small module or class", False),
)

TOPICS = """dates and time zones, CSV import, HTTP clients, caching, command-line arguments, a
todo list, bank accounts, inventory, logging, retries with backoff, matrices, graphs and shortest
paths, JSON configuration, password hashing, rate limiting, walking a directory tree, string
formatting, regular expressions, sorting records, pagination, a linked list, a binary search tree,
a priority queue, a thread pool, async tasks, websockets, environment variables, unit conversion,
image file metadata, a key-value store, an event bus, money and rounding, a state machine, parsing
URLs, reading a large file in chunks, a shopping basket, user sessions, feature flags, a leaderboard,
temperature sensors, a chess board, a tokenizer, a markdown table, a word counter, a cron-like
scheduler, database migrations, a REST API, dependency injection, a trie, interval merging, a
calendar, an LRU structure, serialisation, checksums, a progress bar, text wrapping, a game of life,
queues and workers, memoisation, validating forms, file locks, signals and shutdown""".replace("\n", " ")
TOPIC_LIST = [t.strip() for t in TOPICS.split(",") if t.strip()]
SQL_LANG = "SQL"
SELF_LANGUAGES = [*LANGUAGES, SQL_LANG]

# Hand-written example requests for the few-shot page (language, task key, request). None of them
# is an evaluation prompt; the dedupe index checks the generated ones as well.
SEEDS: tuple[tuple[str, str, str], ...] = (
    (
        "Python",
        "write",
        "I need a Python function that groups a list of (name, score) pairs by name and returns the average score of each, sorted from best to worst.",
    ),
    (
        "Go",
        "fix",
        "This Go function is supposed to reverse a slice in place but the second half comes out wrong. What did I miss?\n\n```go\nfunc reverse(xs []int) {\n    for i := 0; i < len(xs); i++ {\n        j := len(xs) - 1 - i\n        xs[i], xs[j] = xs[j], xs[i]\n    }\n}\n```",
    ),
    (
        "JavaScript",
        "tests",
        "Can you write Jest tests for this helper? I care about empty strings and strings with only spaces.\n\n```js\nexport function initials(fullName) {\n  return fullName.trim().split(/\\s+/).map(p => p[0].toUpperCase()).join('');\n}\n```",
    ),
    (
        "Rust",
        "concept",
        "What is the difference between Box<dyn Trait> and impl Trait in Rust function signatures? A small example of when each one is the right choice would help.",
    ),
    (
        "Bash",
        "write",
        "Write a bash one-liner or short script that prints the 10 largest files under the current directory with human-readable sizes.",
    ),
    (
        "Python",
        "types",
        "Please add type hints to this, I'm not sure what to do with the callback:\n\n```python\ndef retry(fn, attempts, on_error=None):\n    for i in range(attempts):\n        try:\n            return fn()\n        except Exception as e:\n            if on_error:\n                on_error(i, e)\n    raise RuntimeError('all attempts failed')\n```",
    ),
    (
        "TypeScript",
        "refactor",
        "This works but it's ugly. How would you clean it up?\n\n```ts\nfunction label(status: number): string {\n  if (status === 200) { return 'ok'; }\n  else if (status === 404) { return 'not found'; }\n  else if (status === 500) { return 'server error'; }\n  else { return 'unknown'; }\n}\n```",
    ),
    (
        "SQL",
        "write",
        "I have tables posts(id, author_id, created_at) and comments(id, post_id, created_at). Write a query that returns the 5 posts with the most comments in the last 30 days.",
    ),
    (
        "Java",
        "explain",
        "What does this Java method do, and is it thread-safe?\n\n```java\npublic static synchronized int nextId() {\n    counter = counter + 1;\n    return counter;\n}\n```",
    ),
    (
        "C++",
        "error",
        "My C++ build fails with `error: use of deleted function 'std::unique_ptr<T>::unique_ptr(const std::unique_ptr<T>&)'` on the line `auto copy = items[0];`. What does it mean and how do I fix it?",
    ),
    (
        "C#",
        "design",
        "I'm writing a small C# console app that tracks expenses. How should I structure the classes for categories, expenses and monthly reports? Show the skeleton.",
    ),
    (
        "Python",
        "port",
        "How would this look in Rust? I'd like it to return an Option when there is no '=' in the line.\n\n```python\ndef parse_kv(line):\n    key, sep, value = line.partition('=')\n    if not sep:\n        return None\n    return key.strip(), value.strip()\n```",
    ),
    (
        "C",
        "write",
        "Write a C function that counts the words in a null-terminated string, where words are separated by any whitespace.",
    ),
    (
        "Python",
        "error",
        "I get `TypeError: unhashable type: 'list'` when I run `seen = set(); seen.add(row)` in a loop over rows from csv.reader. Why, and what's the fix?",
    ),
    (
        "Go",
        "concept",
        "When should I use a buffered channel instead of an unbuffered one in Go? Please explain with a short producer/consumer example.",
    ),
    (
        "JavaScript",
        "fix",
        "Why does this print 3 three times instead of 0, 1, 2?\n\n```js\nfor (var i = 0; i < 3; i++) {\n  setTimeout(() => console.log(i), 10);\n}\n```",
    ),
    (
        "Rust",
        "write",
        "Write a Rust function that takes a &str and returns a HashMap<char, usize> with the count of each character, ignoring whitespace.",
    ),
    (
        "Bash",
        "fix",
        "This is meant to back up every .conf file but it only copies the first one:\n\n```bash\nfor f in /etc/myapp/*.conf\ncp $f /backup/\ndone\n```",
    ),
    (
        "TypeScript",
        "types",
        "Give this function proper TypeScript types, including the shape of the options object:\n\n```js\nfunction paginate(items, options) {\n  const page = options.page || 1;\n  const size = options.size || 20;\n  return items.slice((page - 1) * size, page * size);\n}\n```",
    ),
    (
        "Python",
        "refactor",
        "Can you make this more pythonic?\n\n```python\nresult = []\nfor i in range(len(names)):\n    if ages[i] >= 18:\n        result.append(names[i].upper())\n```",
    ),
    (
        "Java",
        "tests",
        "Write JUnit 5 tests for this method:\n\n```java\npublic static boolean isLeapYear(int year) {\n    return (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;\n}\n```",
    ),
    (
        "SQL",
        "fix",
        "This query is supposed to list customers without orders but it returns nothing. Why?\n\n```sql\nSELECT name FROM customers WHERE id NOT IN (SELECT customer_id FROM orders);\n```",
    ),
    ("C#", "write", "In C#, how do I read a text file asynchronously and return the number of non-empty lines?"),
    (
        "Go",
        "design",
        "I want a small Go package for an in-memory rate limiter per API key. What would the types and methods look like? Please include the code for the main type.",
    ),
)

HEADER = "### Request ({lang}, {task}, topic: {topic})\n"
PAGE_INTRO = (
    "Real messages that developers sent to a coding assistant. Each is one complete, specific "
    "request written by the developer; many paste the code they are working on.\n\n"
)
SHOTS = 3
_BAD_START = re.compile(r"^(sure|certainly|here is|here's|as an ai|i'm sorry|of course)\b", re.I)


def meta_prompt(lang: str, task: Task, topic: str, rng: random.Random) -> str:
    """The few-shot page whose continuation is one request of ``task`` in ``lang`` on ``topic``."""
    shots = rng.sample(SEEDS, SHOTS)
    by_key = {t.key: t for t in TASKS}
    parts = [PAGE_INTRO]
    for s_lang, s_key, text in shots:
        parts.append(HEADER.format(lang=s_lang, task=by_key[s_key].header, topic=rng.choice(TOPIC_LIST)))
        parts.append(text.strip() + "\n\n")
    parts.append(HEADER.format(lang=lang, task=task.header, topic=topic))
    return "".join(parts)


def clean_request(text: str, task: Task) -> str | None:
    """The request in a sampled continuation, or None when it is not a usable request."""
    cut = text.split("\n###", 1)[0].strip()
    if not 25 <= len(cut) <= 1800:
        return None
    if _BAD_START.match(cut) or "Request (" in cut:
        return None
    if cut.count("```") % 2:  # an unfinished code block
        return None
    if task.code and "```" not in cut:
        return None
    return cut


@dataclass(frozen=True)
class Slot:
    """What one sampled request should be about."""

    lang: str
    task: Task
    topic: str


def plan_slots(n: int, seed: int) -> list[Slot]:
    """``n`` (language, task, topic) slots: every language x task pair in turn, topics shuffled."""
    rng = random.Random(seed)
    pairs = [(lang, t) for lang in SELF_LANGUAGES for t in TASKS]
    out: list[Slot] = []
    while len(out) < n:
        rng.shuffle(pairs)
        out.extend(Slot(lang, t, rng.choice(TOPIC_LIST)) for lang, t in pairs)
    return out[:n]


@torch.no_grad()
def sample_requests(
    model: Any,
    tokenizer: Any,
    slots: Sequence[Slot],
    *,
    seed: int = 0,
    batch_size: int = 32,
    max_new_tokens: int = 160,
    temperature: float = 0.8,
    top_p: float = 0.95,
    progress: Callable[[dict[str, Any]], None] | None = None,
    journal: Path | None = None,
) -> list[TrainPrompt]:
    """Sample one request per slot with the target (``model``: a transformers causal LM).

    Slots whose continuation is not a usable request (``clean_request``) give nothing, so the
    list can be shorter than ``slots``. Seeded: the same seed and slots give the same requests on
    the same machine. ``journal`` (a JSON-lines file) records each finished batch, so an
    interrupted run samples only the batches it had not finished.
    """
    rng = random.Random(seed)
    pad_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    done = _read_journal(journal)
    out: list[TrainPrompt] = []
    try:
        for bi, start in enumerate(range(0, len(slots), batch_size)):
            batch = slots[start : start + batch_size]
            pages = [meta_prompt(s.lang, s.task, s.topic, rng) for s in batch]  # advances rng either way
            key = _batch_key(seed, bi, batch, max_new_tokens, temperature, top_p)
            if key in done:
                out.extend(TrainPrompt(text, True, source) for text, source in done[key])
                continue
            enc = tokenizer(pages, return_tensors="pt", padding=True).to(device)
            torch.manual_seed(seed * 100_003 + bi)
            gen = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=True,
                temperature=temperature,
                top_p=top_p,
                stop_strings=["\n###"],
                tokenizer=tokenizer,
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            )
            texts = tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            kept = []
            for s, text in zip(batch, texts, strict=True):
                req = clean_request(text, s.task)
                if req is not None:
                    kept.append(TrainPrompt(req, True, f"self-{s.task.key}:{s.lang}:{s.topic}"))
            out.extend(kept)
            if journal is not None:
                with journal.open("a", encoding="utf-8") as f:
                    f.write(json.dumps({"key": key, "requests": [[p.text, p.source] for p in kept]}) + "\n")
            if progress is not None:
                progress({"requests_sampled": start + len(batch), "requests_kept": len(out), "of": len(slots)})
    finally:
        tokenizer.padding_side = pad_side
    return out


def _batch_key(seed: int, bi: int, batch: Sequence[Slot], *settings: float) -> str:
    what = [seed, bi, [(s.lang, s.task.key, s.topic) for s in batch], list(settings)]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


def _read_journal(path: Path | None) -> dict[str, list[tuple[str, str]]]:
    """Finished batches of an earlier run (a torn last line, from a kill mid-write, is ignored)."""
    done: dict[str, list[tuple[str, str]]] = {}
    if path is None or not path.exists():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
            done[row["key"]] = [(str(t), str(src)) for t, src in row["requests"]]
        except (ValueError, KeyError, TypeError):
            continue
    return done


def build_self_prompts(
    model: Any,
    tokenizer: Any,
    seed: int = 0,
    max_prompts: int | None = None,
    batch_size: int = 32,
    progress: Callable[[dict[str, Any]], None] | None = None,
    journal: Path | None = None,
) -> list[TrainPrompt]:
    """Requests written by the target, deduplicated, without evaluation prompts, mixed evenly.

    About a third of the samples are dropped by the cleaning, so ``max_prompts`` (default 512)
    slots are oversampled by half; the result holds at most ``max_prompts`` requests.
    """
    want = 512 if max_prompts is None else max_prompts
    slots = plan_slots(want + want // 2, seed)
    sampled = sample_requests(
        model, tokenizer, slots, seed=seed, batch_size=batch_size, progress=progress, journal=journal
    )
    pools: dict[str, list[TrainPrompt]] = {}
    for p in sampled:
        pools.setdefault(p.kind, []).append(p)
    pools = drop_evaluation_duplicates(pools)
    mix = {k: 1.0 / len(pools) for k in pools} if pools else {}
    return merge_by_mix(pools, mix, want)
