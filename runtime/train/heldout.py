"""Held-out coding prompts for drafter evaluation.

Written for this project; none of them is derived from the training prompts (the Python standard
library) or from the bench sets. Chat prompts go through the chat template; raw ones are completed.
"""

from __future__ import annotations

from runtime.train.prompt_list import TrainPrompt

HELDOUT: list[TrainPrompt] = [
    TrainPrompt(
        "Write a Python function that merges overlapping intervals in a list of [start, end] pairs.", True, "heldout"
    ),
    TrainPrompt("Write a Python function that checks whether a string is a valid IPv4 address.", True, "heldout"),
    TrainPrompt("Implement an LRU cache class in Python using collections.OrderedDict.", True, "heldout"),
    TrainPrompt("Write a Python function that returns the n-th Fibonacci number using memoisation.", True, "heldout"),
    TrainPrompt("Write a Python script that counts the lines, words and characters of a text file.", True, "heldout"),
    TrainPrompt("Write a Python function that converts a Roman numeral string to an integer.", True, "heldout"),
    TrainPrompt("Write a JavaScript function that debounces another function.", True, "heldout"),
    TrainPrompt("Write a Python class for a bank account with deposit, withdraw and balance methods.", True, "heldout"),
    TrainPrompt(
        "import json\nfrom pathlib import Path\n\n\ndef load_config(path: Path) -> dict:\n"
        '    """Load a JSON config file and fill in default values."""\n',
        False,
        "heldout",
    ),
    TrainPrompt(
        'class Stack:\n    """A simple LIFO stack."""\n\n    def __init__(self):\n        self._items = []\n\n'
        "    def push(self, item):\n",
        False,
        "heldout",
    ),
    TrainPrompt(
        "def binary_search(items: list[int], target: int) -> int:\n"
        '    """Return the index of target in the sorted list items, or -1."""\n',
        False,
        "heldout",
    ),
    TrainPrompt(
        'import csv\n\n\ndef read_rows(path):\n    """Yield each row of a CSV file as a dict."""\n',
        False,
        "heldout",
    ),
    TrainPrompt(
        "def is_palindrome(s: str) -> bool:\n"
        '    """Check whether s reads the same forwards and backwards, ignoring case and spaces."""\n',
        False,
        "heldout",
    ),
    TrainPrompt(
        "from dataclasses import dataclass\n\n\n@dataclass\nclass Point:\n    x: float\n    y: float\n\n"
        '    def distance_to(self, other: "Point") -> float:\n',
        False,
        "heldout",
    ),
    TrainPrompt("Write a Python function that flattens an arbitrarily nested list.", True, "heldout"),
    TrainPrompt("Write a Go function that reverses a slice of integers in place.", True, "heldout"),
]


def ood_prompts() -> list[TrainPrompt]:
    """The out-of-distribution set: hand-written chat coding requests of kinds the v1 generator never
    made (code edits, tests, bug fixes, Go/Rust/SQL/bash/JS, explanations, multi-turn), shipped as
    ``runtime/assets/prompts/ood-chat.jsonl`` (also ``dflash bench --dataset ood-chat``)."""
    from runtime.bench.datasets import load_dataset

    return [
        TrainPrompt(p.text, True, f"ood:{p.id}", tuple(p.messages) if p.messages else None)
        for p in load_dataset("ood-chat").prompts
    ]
