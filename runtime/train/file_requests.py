"""Prompt generator "files": requests for whole application source files, one file per answer.

An editor asks for the middle of a file a user is writing: application code (a handler, a small
service, a command-line tool, a data structure with its methods) in the language of the project.
The chat generators' answers hold mostly short snippets, and most of them in Python; a machine's
own source files are mostly library code in a few languages. This generator asks the target for
whole files of 20-60 lines in every language the editors' users write (the languages of
``dflash bench --dataset fim``, C# besides), on varied topics, so that ``dflash train --fim-from
DATASET`` can cut holes in code the target itself wrote, and the middles it then answers are its
own completions of its own kind of file.

Each request names the language, a file name, a topic and what the file holds (``SHAPES``); the
reply is asked for as one fenced code block. ``source`` is ``file:LANG:TOPIC``. Requests that
duplicate an evaluation prompt are dropped, as in every generator.
"""

from __future__ import annotations

import random
import re

from runtime.train.prompt_list import TrainPrompt
from runtime.train.selfinstruct import TOPIC_LIST

# language -> (file suffix, fence tag, what a file of it holds: one is picked per request)
SHAPES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "Python": (
        ".py",
        "python",
        (
            "a class with a few methods, a helper function and a `main()` that uses them",
            'a few functions with type hints and docstrings, and an `if __name__ == "__main__":` block',
            "a dataclass, the functions that work on it and a short command-line entry point",
        ),
    ),
    "JavaScript": (
        ".js",
        "javascript",
        (
            "a class with its methods and a short usage example at the end",
            "a few functions exported with `module.exports` and a small example of their use",
            "an async function or two with error handling, and the code that calls them",
        ),
    ),
    "TypeScript": (
        ".ts",
        "typescript",
        (
            "an interface, a class implementing it and an exported function that uses the class",
            "types for the data, a few exported functions on them and a short example",
            "a generic class with its methods and a small example of its use",
        ),
    ),
    "Go": (
        ".go",
        "go",
        (
            "a struct with methods, a constructor function and a `main` that uses them",
            "a few functions that return errors, and a `main` that handles them",
            "a type with methods and a small `main` that exercises them",
        ),
    ),
    "Rust": (
        ".rs",
        "rust",
        (
            "a struct with an `impl` block, an error enum and a `main` that uses them",
            "a few functions returning `Result`, and a `main` that calls them",
            "a struct, a trait it implements and a short `main`",
        ),
    ),
    "Java": (
        ".java",
        "java",
        (
            "one public class with fields, a constructor, a few methods and a `main` method",
            "a class with static helper methods and a `main` method that uses them",
            "an interface, a class implementing it and a `main` method",
        ),
    ),
    "C": (
        ".c",
        "c",
        (
            "a struct, the functions that work on it and a `main` that uses them",
            "a few functions with their includes and a `main` that tests them",
            "functions that read input, check for errors and print a result, with a `main`",
        ),
    ),
    "C++": (
        ".cpp",
        "cpp",
        (
            "a class with a constructor, a few member functions and a `main` that uses it",
            "a few functions using the standard library (vector, string, map) and a `main`",
            "a small template function or class and a `main` that uses it",
        ),
    ),
    "C#": (
        ".cs",
        "csharp",
        (
            "a class with properties and methods and a `Main` method that uses it",
            "a static class with helper methods and a `Main` method",
        ),
    ),
    "Bash": (
        ".sh",
        "bash",
        (
            "a script with `set -euo pipefail`, a few functions, argument checks and a main section",
            "a script that parses its options, checks its inputs and loops over files",
        ),
    ),
    "SQL": (
        ".sql",
        "sql",
        (
            "the CREATE TABLE statements for two or three related tables and a few queries on them",
            "a table, an index, a few INSERTs and three queries with JOINs and GROUP BY",
        ),
    ),
}
# share of requests per language: the FIM bench's languages by their share of it, C# a little
MIX: dict[str, float] = {
    "Python": 0.2,
    "TypeScript": 0.11,
    "JavaScript": 0.1,
    "Go": 0.11,
    "Rust": 0.11,
    "Java": 0.09,
    "C": 0.08,
    "C++": 0.06,
    "SQL": 0.05,
    "Bash": 0.05,
    "C#": 0.04,
}
TEMPLATES = (
    "Write the {lang} file `{name}` for {topic}: {shape}. About {lines} lines. "
    "Reply with the whole file in one ```{fence} code block.",
    "I need a {lang} source file, `{name}`, about {topic}. It should contain {shape}. "
    "Keep it to roughly {lines} lines and show the complete file in a ```{fence} block.",
    "Create `{name}` in {lang} ({topic}) with {shape}. Give me the full file, around {lines} lines, "
    "as one ```{fence} code block.",
)


def _file_name(topic: str, suffix: str, lang: str) -> str:
    words = re.findall(r"[a-z0-9]+", topic.lower())
    words = [w for w in words if w not in ("a", "an", "the", "and", "with", "of")][:3] or ["main"]
    if lang in ("Java", "C#"):
        return "".join(w.capitalize() for w in words) + suffix
    sep = "-" if lang in ("JavaScript", "TypeScript", "Bash") else "_"
    return sep.join(words) + suffix


def build_file_requests(seed: int = 0, max_prompts: int | None = None, dedupe: bool = True) -> list[TrainPrompt]:
    """Chat requests for whole source files, languages mixed by ``MIX`` (each language's topics
    shuffled by ``seed`` and used once before any repeats), in an order that interleaves them."""
    from runtime.train.generator import drop_evaluation_duplicates
    from runtime.train.text import furthest_below_share

    rng = random.Random(seed)
    n = max_prompts if max_prompts is not None else len(TOPIC_LIST) * len(SHAPES)
    topics = {lang: rng.sample(TOPIC_LIST, len(TOPIC_LIST)) for lang in SHAPES}
    taken = dict.fromkeys(SHAPES, 0)
    out: list[TrainPrompt] = []
    for _ in range(n * 2):  # room for the dedupe below
        lang = furthest_below_share(SHAPES, taken, MIX)
        suffix, fence, shapes = SHAPES[lang]
        topic = topics[lang][taken[lang] % len(TOPIC_LIST)]
        taken[lang] += 1
        text = rng.choice(TEMPLATES).format(
            lang=lang,
            name=_file_name(topic, suffix, lang),
            topic=topic,
            shape=rng.choice(shapes),
            lines=rng.choice((25, 30, 40, 50, 60)),
            fence=fence,
        )
        out.append(TrainPrompt(text, True, f"file:{lang}:{topic}"))
    if dedupe:
        out = drop_evaluation_duplicates({"file": out})["file"]
    return out[:n]
