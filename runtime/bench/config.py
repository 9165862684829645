"""What ``dflash bench`` measures: ``BenchConfig`` (methods, sweeps, budget, sampling, warm-up),
checked on construction, and the rows it expands to (``MethodSpec``)."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.bench.datasets import PromptMode
from runtime.config import GREEDY_BELOW, MAX_LOOKUP
from runtime.errors import ConfigError

METHODS = ("ar", "hf", "pld", "assisted", "dflash")


@dataclass(frozen=True)
class BenchConfig:
    """What to measure.

    Attributes:
        methods: methods to run (``ar`` is always added: it is the baseline).
        block_sizes: DFlash block sizes to sweep (empty: the runtime's own choice of block and
            verify length, as ``dflash run`` uses).
        verify_length: drafts verified per DFlash step (None: the runtime's choice).
        tree_budgets: tree budgets to sweep for DFlash (0: the chain, None: the runtime's choice);
            empty: one row with ``tree_budget``.
        tree_budget: tree budget of the DFlash rows when not sweeping (None: the runtime's choice).
        lookups: context-lookup lengths to sweep for DFlash (0: off, None: the runtime's default);
            empty: one row with ``lookup``.
        lookup: context-lookup length of the DFlash rows when not sweeping (None: the default).
        max_new_tokens: tokens generated per prompt.
        temperature: 0 for greedy (tokens are then checked against ``ar``).
        seed: sampling seed.
        warmup: untimed runs per method before timing.
        stop_at_eos: stop at EOS (default: fixed-length runs of ``max_new_tokens``).
        pld_tokens: drafts per step for prompt lookup (transformers' ``prompt_lookup_num_tokens``).
        pld_ngram: longest n-gram prompt lookup matches (``max_matching_ngram_size``).
        mode: force "raw" or "chat" prompts (None: each prompt set's own).
        thinking: turn the chat template's thinking mode on (where it has one).
    """

    methods: tuple[str, ...] = ("ar", "hf", "pld", "dflash")
    block_sizes: tuple[int, ...] = ()
    verify_length: int | None = None
    tree_budgets: tuple[int | None, ...] = ()
    tree_budget: int | None = None
    lookups: tuple[int | None, ...] = ()
    lookup: int | None = None
    confidence_cut: bool | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    warmup: int = 1
    stop_at_eos: bool = False
    pld_tokens: int = 10
    pld_ngram: int = 2
    mode: PromptMode | None = None
    thinking: bool = False

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ConfigError(f"unknown bench method {unknown[0]!r}; use some of {', '.join(METHODS)}")
        if not self.methods:
            raise ConfigError(f"name at least one method among {', '.join(METHODS)}")
        bad = [b for b in self.block_sizes if b < 2]
        if bad:
            raise ConfigError(f"--block-size values must be >= 2 (block size 1 is the ar row), got {bad[0]}")
        if self.block_sizes and "dflash" not in self.methods:
            raise ConfigError("--block-size sweeps DFlash block sizes; add dflash to --methods")
        if self.verify_length is not None and self.verify_length < 1:
            raise ConfigError(f"--verify-length must be >= 1, got {self.verify_length}")
        budgets = [b for b in (*self.tree_budgets, self.tree_budget) if b is not None]
        if any(b < 0 for b in budgets):
            raise ConfigError(f"tree budgets must be >= 0 (0 = chain), got {min(budgets)}")
        if self.tree_budgets and "dflash" not in self.methods:
            raise ConfigError("--tree-budgets sweeps DFlash tree budgets; add dflash to --methods")
        if self.lookups and "dflash" not in self.methods:
            raise ConfigError("--lookups sweeps DFlash's context lookup; add dflash to --methods")
        if any(n is not None and not 0 <= n <= MAX_LOOKUP for n in (*self.lookups, self.lookup)):
            raise ConfigError(f"lookup lengths must be in [0, {MAX_LOOKUP}] (0 = off)")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        if self.pld_tokens < 1 or self.pld_ngram < 1:
            raise ConfigError("prompt lookup needs --pld-tokens >= 1 and an n-gram size >= 1")
        if self.mode not in (None, "raw", "chat"):
            raise ConfigError(f"prompt mode must be raw or chat, got {self.mode!r}")

    @property
    def greedy(self) -> bool:
        """True when every method decodes greedily (tokens are checked against ``ar``)."""
        return self.temperature < GREEDY_BELOW

    def specs(self) -> list[MethodSpec]:
        """The rows to measure: ``ar`` first, then the other methods in ``METHODS`` order."""
        out = [MethodSpec("ar", "ar")]
        for m in METHODS[1:]:
            if m not in self.methods:
                continue
            if m == "dflash" and (self.block_sizes or self.tree_budgets or self.lookups):
                blocks: tuple[int | None, ...] = tuple(dict.fromkeys(self.block_sizes)) or (None,)
                trees = tuple(dict.fromkeys(self.tree_budgets)) or (self.tree_budget,)
                looks = tuple(dict.fromkeys(self.lookups)) or (self.lookup,)
                for b in blocks:
                    for t in trees:
                        for n in looks:
                            name = "dflash" + (f"-b{b}" if b else "")
                            if self.tree_budgets:
                                name += "-chain" if t == 0 else ("-tree-auto" if t is None else f"-tree{t}")
                            if self.lookups:
                                name += "-lookup-auto" if n is None else f"-lookup{n}"
                            out.append(MethodSpec(name, "dflash", b, t, n))
            elif m == "dflash":
                out.append(MethodSpec(m, m, None, self.tree_budget, self.lookup))
            else:
                out.append(MethodSpec(m, m))
        return out


@dataclass(frozen=True)
class MethodSpec:
    """One row of the bench: a method, and for DFlash a block size (None: the drafter's own), a
    tree budget (0: chain, None: the runtime's choice) and a context-lookup length (0: off, None:
    the default)."""

    name: str
    method: str
    block_size: int | None = None
    tree_budget: int | None = None
    lookup: int | None = None
