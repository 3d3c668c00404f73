"""Shared test check: an exported kernel header against the ABI the runtime packs."""

from __future__ import annotations

import re

from maskc.artifact.abi import Arg, TensorArg


def assert_header_matches_abi(header: str, abi: tuple[Arg, ...]) -> None:
    """Each tensor struct in the header holds exactly the ABI's dynamic extents, no strides."""
    structs = re.findall(r"typedef struct \{\s*void \*data;(.*?)\} \w+_Tensor_(\w+)_t;", header, flags=re.S)
    tensors = [a for a in abi if isinstance(a, TensorArg)]
    assert len(structs) == len(tensors)
    for (body, _name), arg in zip(structs, tensors):
        dims = re.findall(r"int32_t dynamic_shapes\[(\d+)\];", body)
        assert [int(d) for d in dims] == ([len(arg.dynamic_dims())] if arg.dynamic_dims() else []), arg.name
        assert "dynamic_strides" not in body, arg.name
