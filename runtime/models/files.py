"""What a model folder holds, read from its files without loading any weights.

A safetensors file starts with an 8-byte little-endian header length and a JSON header that lists
every tensor's dtype, shape and byte range; reading it costs a few kilobytes even for a 16 GB
shard. From the headers alone this module counts parameters (for memory estimates) and finds
truncated or corrupt files, missing shards, broken cache links and pickle-only folders.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

_MAX_HEADER = 100 * 1024 * 1024
_DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class SafetensorsInfo:
    """Header summary of one safetensors file.

    Attributes:
        params: number of tensor elements.
        data_bytes: bytes the header says the data takes.
        problem: None when the file is whole, else why not (truncated, bad header).
    """

    params: int = 0
    data_bytes: int = 0
    problem: str | None = None


def read_safetensors(path: Path) -> SafetensorsInfo:
    """Parse a safetensors header and compare it with the file size.

    Args:
        path: the ``.safetensors`` file (a cache symlink is followed).

    Returns:
        Parameter count and data size, or the problem found.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return SafetensorsInfo(problem=f"{path.name} is truncated ({size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                return SafetensorsInfo(problem=f"{path.name} is truncated or not a safetensors file")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        return SafetensorsInfo(problem=f"{path.name} is missing (broken link into the cache)")
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return SafetensorsInfo(problem=f"{path.name} has an unreadable header ({type(e).__name__})")
    params, end = 0, 0
    for name, t in header.items():
        if name == "__metadata__" or not isinstance(t, dict):
            continue
        count = 1
        for d in t.get("shape", []):
            count *= int(d)
        params += count
        end = max(end, int(t.get("data_offsets", [0, 0])[1]))
    if 8 + n + end > size:
        return SafetensorsInfo(
            params, end, f"{path.name} is truncated ({size} of {8 + n + end} bytes): the download did not finish"
        )
    return SafetensorsInfo(params, end)


@dataclass(frozen=True)
class FolderReport:
    """Integrity of a model folder.

    Attributes:
        params: total parameters in its safetensors files.
        weight_bytes: bytes of tensor data on disk.
        weights: names of the safetensors files found.
        problems: one line per problem (empty: the folder is usable).
        missing: file names that should be there and are not.
    """

    params: int = 0
    weight_bytes: int = 0
    weights: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    missing: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        """True when nothing is missing or broken."""
        return not self.problems


def inspect_folder(folder: Path, expected: tuple[str, ...] = ()) -> FolderReport:
    """Check a model folder: config, every shard of the index, whole safetensors, expected files.

    Args:
        folder: a local model folder or a Hub cache snapshot.
        expected: extra file names that must exist (e.g. from the Hub's tree listing).

    Returns:
        A ``FolderReport``; ``problems`` is empty when the folder is usable.
    """
    problems: list[str] = []
    missing: list[str] = []
    if not (folder / "config.json").exists():
        missing.append("config.json")
    index = folder / "model.safetensors.index.json"
    shards: list[str] = []
    if index.exists():
        from runtime.engine.models.drafter_schema import read_weight_index
        from runtime.errors import ModelLoadError

        try:
            shards = read_weight_index(index)
        except ModelLoadError as e:  # names the file and what is wrong with it
            problems.append(str(e))
    listed = {n for n in expected if n.endswith(".safetensors")}
    names = sorted({p.name for p in folder.glob("*.safetensors")} | set(shards) | listed)
    for name in expected:
        if not (folder / name).exists() and name not in missing:
            missing.append(name)
    params = nbytes = 0
    found = []
    for name in names:
        path = folder / name
        if not path.exists():
            if name not in missing:
                missing.append(name)
            continue
        info = read_safetensors(path)
        params += info.params
        nbytes += info.data_bytes
        found.append(name)
        if info.problem:
            problems.append(info.problem)
    problems = [f"{m} is missing" for m in missing] + problems
    if not names:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES) if folder.is_dir() else []
        hint = f" (only pickle weights: {', '.join(pickles)}; dflash never loads those)" if pickles else ""
        problems.append(f"no .safetensors weights{hint}")
    return FolderReport(params, nbytes, tuple(found), tuple(problems), tuple(missing))
