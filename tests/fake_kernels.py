"""Shared test helper: a kernel's manifest record and a stand-in object, named and exporting as
`maskc compile` writes them, so that verification takes the object for the kernel its fields
describe without compiling anything."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from maskc.artifact.abi import ENTRY_POINTS, abi_to_json
from maskc.artifact.manifest import exported_symbol
from maskc.artifact.variant import KernelVariant, variant_for

#: A kernel request: the sm90 forward at d=128 for 8 query and 8 K/V heads.
REQUEST = {"arch": "sm_90a", "direction": "fwd", "head_dim": 128, "dtype": "bf16", "num_heads_q": 8, "num_heads_kv": 8}
#: Its variant's fields, as a manifest records them, and its key.
FIELDS = asdict(variant_for(REQUEST))
KEY = variant_for(REQUEST).key()


def fake_kernel(directory: Path, fields: Mapping[str, Any] = FIELDS, data: bytes = b"object bytes") -> dict:
    """Write a stand-in object for the kernel with `fields` into `directory` (`data`, then the
    symbol the export defines); its manifest record, the object named relative to `directory`."""
    variant = KernelVariant(**fields)
    entry = ENTRY_POINTS[variant.direction]
    record = {"key": variant.key(), "object": f"{variant.key()}.o", "function": entry.name,
              "abi": abi_to_json(entry.args), "fields": asdict(variant)}  # fmt: skip
    (directory / record["object"]).write_bytes(data + exported_symbol(entry.name))
    return record
