"""Reading a batch job's input rows and writing its output parts.

Inputs: ``.npy`` (one array: the rows of one model input), ``.npz`` (one array per model
input, by name), Parquet (one column per model input: scalars, or lists holding one row's
tensor), JSON Lines (one KServe v2 request per line). Every input is checked against the
model's configuration (names, per-row shapes, datatypes) before a request is sent; numeric
data of another numeric type is converted as numpy would (``float64`` to ``FP32`` ...).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sluice.config import ModelConfig, TensorSpec
from sluice.datatypes import numpy_dtype
from sluice.errors import InvalidInput

_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")


def safe_name(name: str) -> str:
    """An output name usable in a file name (others are hex-encoded)."""
    return name if _SAFE_NAME.fullmatch(name) else "x" + name.encode().hex()[:120]


class InputReader(ABC):
    rows: int

    @abstractmethod
    def read(self, start: int, end: int) -> dict[str, np.ndarray]:
        """Rows ``start`` to ``end`` of every model input, as the model takes them."""


def open_input(path: Path, fmt: str, config: ModelConfig, input_name: str) -> InputReader:
    try:
        if fmt == "npy":
            return NpyReader(path, config, input_name)
        if fmt == "npz":
            return NpzReader(path, config)
        if fmt == "parquet":
            return ParquetReader(path, config)
        if fmt == "jsonl":
            return JsonLinesReader(path)
    except (OSError, ValueError, EOFError) as exc:
        raise InvalidInput(f"'input': cannot read it as {fmt}: {exc}") from None
    raise InvalidInput(f"'input': unknown format {fmt}")


def _spec(config: ModelConfig, name: str) -> TensorSpec:
    for spec in config.inputs:
        if spec.name == name:
            return spec
    names = ", ".join(s.name for s in config.inputs)
    raise InvalidInput(f"model '{config.name}' has no input '{name}' (inputs: {names})")


def conform(array: np.ndarray, spec: TensorSpec, where: str) -> np.ndarray:
    """``array`` (rows first) as the model input ``spec`` takes it, or InvalidInput."""
    dims = tuple(spec.dims)
    row_shape = array.shape[1:]
    if len(row_shape) != len(dims) or any(
        d != -1 and d != r for d, r in zip(dims, row_shape, strict=False)
    ):
        raise InvalidInput(
            f"{where}: rows of shape {list(row_shape)} do not fit input '{spec.name}' "
            f"(dims {list(dims)})"
        )
    datatype = spec.datatype
    if datatype == "BYTES":
        if array.dtype.kind not in ("O", "S", "U"):
            raise InvalidInput(f"{where}: input '{spec.name}' takes BYTES, not {array.dtype}")
        return array.astype(object)
    wanted = numpy_dtype(datatype)
    if array.dtype == wanted:
        return array
    if array.dtype.kind not in "biuf" or wanted.kind not in "biuf":
        raise InvalidInput(f"{where}: input '{spec.name}' takes {datatype}, not {array.dtype}")
    return array.astype(wanted)


class NpyReader(InputReader):
    def __init__(self, path: Path, config: ModelConfig, input_name: str) -> None:
        if not input_name:
            if len(config.inputs) != 1:
                names = ", ".join(s.name for s in config.inputs)
                raise InvalidInput(
                    f"model '{config.name}' has several inputs ({names}): name the one the "
                    ".npy file feeds with 'options.input_name', or send an .npz"
                )
            input_name = config.inputs[0].name
        self.spec = _spec(config, input_name)
        self.array = np.load(path, mmap_mode="r", allow_pickle=False)
        if self.array.ndim < 1:
            raise InvalidInput("'input': the array has no rows")
        self.rows = int(self.array.shape[0])
        conform(self.array[:0], self.spec, "'input'")

    def read(self, start: int, end: int) -> dict[str, np.ndarray]:
        return {self.spec.name: conform(np.asarray(self.array[start:end]), self.spec, "'input'")}


class NpzReader(InputReader):
    def __init__(self, path: Path, config: ModelConfig) -> None:
        archive = np.load(path, mmap_mode="r", allow_pickle=False)
        self.arrays: dict[str, Any] = {}
        self.specs = {s.name: s for s in config.inputs if not s.optional}
        for name, spec in self.specs.items():
            if name not in archive.files:
                raise InvalidInput(f"'input': the .npz has no array '{name}' (a model input)")
            self.arrays[name] = archive[name]
            conform(self.arrays[name][:0], spec, f"'input' array '{name}'")
        lengths = {int(a.shape[0]) for a in self.arrays.values()}
        if len(lengths) != 1:
            raise InvalidInput("'input': the .npz arrays do not have the same number of rows")
        self.rows = lengths.pop()

    def read(self, start: int, end: int) -> dict[str, np.ndarray]:
        return {
            name: conform(np.asarray(array[start:end]), self.specs[name], f"'input' '{name}'")
            for name, array in self.arrays.items()
        }


class ParquetReader(InputReader):
    def __init__(self, path: Path, config: ModelConfig) -> None:
        import pyarrow.parquet as pq

        self.file = pq.ParquetFile(path)
        self.rows = int(self.file.metadata.num_rows)
        columns = set(self.file.schema_arrow.names)
        self.specs = {s.name: s for s in config.inputs if not s.optional}
        missing = sorted(set(self.specs) - columns)
        if missing:
            raise InvalidInput(f"'input': the Parquet file has no column {missing[0]!r}")
        self.starts = []
        offset = 0
        for index in range(self.file.num_row_groups):
            self.starts.append(offset)
            offset += self.file.metadata.row_group(index).num_rows

    def read(self, start: int, end: int) -> dict[str, np.ndarray]:
        groups = [
            i
            for i, first in enumerate(self.starts)
            if first < end and first + self.file.metadata.row_group(i).num_rows > start
        ]
        table = self.file.read_row_groups(groups, columns=list(self.specs))
        table = table.slice(start - self.starts[groups[0]], end - start) if groups else table
        out: dict[str, np.ndarray] = {}
        for name, spec in self.specs.items():
            out[name] = conform(_column(table.column(name), spec), spec, f"'input' column '{name}'")
        return out


def _column(column: Any, spec: TensorSpec) -> np.ndarray:
    import pyarrow as pa

    combined = column.combine_chunks()
    kind = combined.type
    if pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind) or pa.types.is_large_list(kind):
        rows = [
            np.asarray(v, dtype=object if _is_bytes(spec) else None) for v in combined.to_pylist()
        ]
        dims = tuple(d if d != -1 else -1 for d in spec.dims)
        return (
            np.stack([r.reshape(dims) for r in rows])
            if rows
            else np.zeros((0, *[max(d, 0) for d in dims]))
        )
    values = combined.to_numpy(zero_copy_only=False)
    if _is_bytes(spec):
        values = np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=object)
    dims = tuple(spec.dims)
    return values.reshape((-1, *dims)) if dims and all(d > 0 for d in dims) else values


def _is_bytes(spec: TensorSpec) -> bool:
    return spec.datatype == "BYTES"


class JsonLinesReader(InputReader):
    """One KServe v2 request per line; a shard reads its lines from a byte offset."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offsets: list[int] = []
        with path.open("rb") as stream:
            offset = 0
            for line in stream:
                if line.strip():
                    self.offsets.append(offset)
                offset += len(line)
        self.rows = len(self.offsets)

    def read(self, start: int, end: int) -> dict[str, np.ndarray]:
        raise NotImplementedError("JSON Lines are read as whole requests: lines()")

    def lines(self, start: int, end: int) -> list[Any]:
        out: list[Any] = []
        with self.path.open("rb") as stream:
            for index in range(start, end):
                stream.seek(self.offsets[index])
                raw = stream.readline()
                try:
                    out.append(json.loads(raw))
                except ValueError as exc:
                    raise InvalidInput(f"'input' line {index + 1}: not JSON: {exc}") from None
        return out


def write_part(fmt: str, outputs: dict[str, np.ndarray], path_for: Any) -> dict[str, Path]:
    """Write one shard's outputs; ``path_for(suffix)`` names a scratch file. Returns the
    files by output name (``""`` for a single file holding every output)."""
    if fmt == "npy":
        files: dict[str, Path] = {}
        for name, array in outputs.items():
            path = path_for(f"{safe_name(name)}.npy")
            np.save(path, array, allow_pickle=array.dtype == object)
            files[name] = path
        return files
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = {}
        for name, array in outputs.items():
            flat = array.reshape(len(array), -1) if array.ndim > 1 else array
            if array.ndim > 1:
                columns[name] = pa.array(list(flat))
            else:
                columns[name] = pa.array(flat)
        path = path_for("parquet")
        pq.write_table(pa.table(columns), path)
        return {"": path}
    raise InvalidInput(f"'options.output_format': cannot write {fmt}")


def write_lines(lines: Sequence[bytes], path: Path) -> dict[str, Path]:
    with path.open("wb") as stream:
        for line in lines:
            stream.write(line)
            stream.write(b"\n")
    return {"": path}
