"""Reading a batch job's input rows and writing its output parts.

Inputs: ``.npy`` (one array: the rows of one model input), ``.npz`` (one array per model
input, by name), Parquet (one column per model input: scalars, or lists holding one row's
tensor), JSON Lines (one KServe v2 request per line, :mod:`sluice.batch.jsonl`). Every input is
checked against the model's configuration (names, per-row shapes, datatypes) before a
request is sent; numeric data of another numeric type is converted as numpy would
(``float64`` to ``FP32`` ...).

An input file comes from a client, so it is read bounded: a shard reads only its own rows
(``.npy`` and stored ``.npz`` members are memory-mapped after their headers are checked
against the file's real size; a compressed ``.npz`` member is expanded once, within
``SLUICE_BATCH_MAX_EXPANDED_BYTES``, into a scratch file; Parquet is read batch by batch
within the row groups a shard covers), and arrays of Python objects, which only pickle
could load, are refused everywhere.
"""

from __future__ import annotations

import re
import struct
import tempfile
import threading
import zipfile
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from sluice.batch.jsonl import non_blank_lines, parse_line
from sluice.core.config import ModelConfig, TensorSpec
from sluice.core.datatypes import element_count, numpy_dtype
from sluice.core.errors import InvalidInput

if TYPE_CHECKING:
    from sluice.core.settings import BatchSettings

MIB = 1 << 20
GIB = 1 << 30
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
_MAX_NPZ_MEMBERS = 10_000
"""An .npz holds one array per model input; an archive listing more is refused before its
directory is read (each listed member costs memory to read)."""
_LOCAL_HEADER = struct.Struct("<4s22xHH")
"""A zip member's local header: signature, then (after 22 bytes) name and extra lengths."""
_CHUNK = 1 << 20
_PARQUET_BATCH_ROWS = 4096
_UNREADABLE = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError)
"""What reading a damaged file raises (numpy's header parser, zip's CRC and inflate, an
unknown compression method)."""
MAX_LINE_BYTES = 64 * MIB
"""Default longest JSON Lines line: one v2 request, as large as one online request may be
(``SLUICE_MAX_BODY_BYTES``)."""
MAX_EXPANDED_BYTES = 8 * GIB
"""Default bound on a compressed ``.npz`` member's expanded size (written to a scratch file,
so this is disk, not memory) and on one Parquet row group's decoded column."""


@dataclass(frozen=True, slots=True)
class InputLimits:
    """Bounds on what reading one input may cost (the batch worker's settings)."""

    max_line_bytes: int = MAX_LINE_BYTES
    """Longest JSON Lines line (``SLUICE_BATCH_MAX_LINE_BYTES``)."""
    max_expanded_bytes: int = MAX_EXPANDED_BYTES
    """Most bytes a compressed ``.npz`` member or one Parquet row group's column may
    expand to (``SLUICE_BATCH_MAX_EXPANDED_BYTES``)."""

    @classmethod
    def of(cls, settings: BatchSettings) -> InputLimits:
        return cls(settings.batch_max_line_bytes, settings.batch_max_expanded_bytes)


def safe_name(name: str) -> str:
    """An output name usable in a file name (others are hex-encoded)."""
    return name if _SAFE_NAME.fullmatch(name) else "x" + name.encode().hex()[:120]


class InputReader(ABC):
    rows: int
    row_bytes: int = 0
    """About what one row of every model input takes in memory once read (0: read a row
    at a time, as JSON Lines are): what bounds a shard's rows (:func:`shard_rows`)."""

    @abstractmethod
    def read(self, start: int, end: int) -> dict[str, np.ndarray]:
        """Rows ``start`` to ``end`` of every model input, as the model takes them."""


def open_input(
    path: Path,
    fmt: str,
    config: ModelConfig,
    input_name: str,
    limits: InputLimits | None = None,
) -> InputReader:
    limits = limits or InputLimits()
    try:
        if fmt == "npy":
            return NpyReader(path, config, input_name)
        if fmt == "npz":
            return NpzReader(path, config, limits)
        if fmt == "parquet":
            return ParquetReader(path, config, limits)
        if fmt == "jsonl":
            return JsonLinesReader(path, limits.max_line_bytes)
    except _UNREADABLE as exc:
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


# -- .npy and .npz: headers first, then only a shard's rows -----------------------------


@dataclass(frozen=True, slots=True)
class _NpyHeader:
    shape: tuple[int, ...]
    fortran_order: bool
    dtype: np.dtype[Any]
    size: int
    """Bytes of the header itself (magic included): the data follows."""

    @property
    def data_bytes(self) -> int:
        return element_count(self.shape) * self.dtype.itemsize


def _npy_header(stream: IO[bytes], where: str, available: int) -> _NpyHeader:
    """The ``.npy`` header at the stream's position, checked: no Python objects, a shape
    with rows, and no more data claimed than the ``available`` bytes (header included)."""
    begin = stream.tell()
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
    else:
        raise InvalidInput(f"{where}: .npy format version {version} is not read")
    header = _NpyHeader(tuple(shape), bool(fortran), dtype, stream.tell() - begin)
    if dtype.hasobject:
        raise InvalidInput(
            f"{where}: the array holds Python objects (dtype {dtype}), which only pickle can "
            "load: refused; save text or bytes as a fixed-width bytes array (dtype 'S')"
        )
    if len(header.shape) < 1:
        raise InvalidInput(f"{where}: the array has no rows")
    if header.size + header.data_bytes > available:
        raise InvalidInput(
            f"{where}: the header claims {header.shape[0]} rows of shape "
            f"{list(header.shape[1:])} ({header.data_bytes} bytes of {dtype}) but the file "
            f"holds {max(available - header.size, 0)} bytes of data"
        )
    return header


def _row_bytes(shape: tuple[int, ...], dtype: np.dtype[Any], spec: TensorSpec) -> int:
    """Bytes one row of an array of ``shape`` and ``dtype`` takes once read, and once
    converted to what ``spec`` takes (both are held while it is converted)."""
    elements = element_count(shape[1:])
    wanted = 8 if spec.datatype == "BYTES" else numpy_dtype(spec.datatype).itemsize
    return elements * (dtype.itemsize + wanted)


def shard_rows(wanted: int, row_bytes: int, max_shard_bytes: int) -> int:
    """The rows of a shard: ``wanted``, fewer where its rows (``row_bytes`` each, inputs
    and outputs) would take more than ``max_shard_bytes`` in a batch worker's memory."""
    if row_bytes <= 0:
        return wanted
    return max(1, min(wanted, max_shard_bytes // row_bytes))


def output_row_bytes(config: ModelConfig) -> int:
    """Bytes one row of the model's outputs takes, counting those of fixed dims and
    numeric types (the size of the others is known only once computed)."""
    total = 0
    for spec in config.outputs:
        if spec.datatype != "BYTES" and all(d > 0 for d in spec.dims):
            total += element_count(spec.dims) * numpy_dtype(spec.datatype).itemsize
    return total


def _mapped(source: Any, header: _NpyHeader, offset: int) -> np.ndarray:
    """The array of ``header`` whose data starts at ``offset`` of ``source`` (a path or an
    open file), mapped, not read; an empty array needs no file."""
    if header.data_bytes == 0:
        return np.empty(header.shape, dtype=header.dtype)
    return np.memmap(
        source,
        dtype=header.dtype,
        mode="r",
        offset=offset,
        shape=header.shape,
        order="F" if header.fortran_order else "C",
    )


def _rows(array: np.ndarray, start: int, end: int, spec: TensorSpec, where: str) -> np.ndarray:
    try:
        return conform(np.array(array[start:end]), spec, where)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"{where}: {exc}") from None


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
        with path.open("rb") as stream:
            header = _npy_header(stream, "'input'", path.stat().st_size)
        self.array = _mapped(path, header, header.size)
        self.rows = int(self.array.shape[0])
        self.row_bytes = _row_bytes(header.shape, header.dtype, self.spec)
        conform(self.array[:0], self.spec, "'input'")

    def read(self, start: int, end: int) -> dict[str, np.ndarray]:
        return {self.spec.name: _rows(self.array, start, end, self.spec, "'input'")}


class _NpzMember:
    """One array of an .npz, read lazily: a stored member is mapped where it lies in the
    archive; a compressed one is expanded once into an unnamed scratch file (gone with the
    mapping), bounded by what its directory entry claims and by ``max_expanded``."""

    def __init__(self, path: Path, archive: zipfile.ZipFile, name: str, max_expanded: int):
        self.where = f"'input' array '{name}'"
        try:
            self.info = archive.getinfo(f"{name}.npy")
        except KeyError:
            raise InvalidInput(f"'input': the .npz has no array '{name}' (a model input)") from None
        if self.info.flag_bits & 0x1:
            raise InvalidInput(f"{self.where} is encrypted")
        self.path = path
        self._lock = threading.Lock()
        self._array: np.ndarray | None = None
        if self.info.compress_type == zipfile.ZIP_STORED:
            self.data_start = self._data_start(path.stat().st_size)
            with path.open("rb") as stream:
                stream.seek(self.data_start)
                self.header = _npy_header(stream, self.where, self.info.file_size)
        else:
            if self.info.file_size > max_expanded:
                raise InvalidInput(
                    f"{self.where} expands to {self.info.file_size} bytes, more than "
                    f"{max_expanded} (SLUICE_BATCH_MAX_EXPANDED_BYTES); store it uncompressed "
                    "(numpy.savez) to have it read in place"
                )
            with archive.open(self.info) as stream:
                self.header = _npy_header(stream, self.where, self.info.file_size)

    def _data_start(self, archive_size: int) -> int:
        """Where a stored member's bytes begin in the archive (after its local header),
        checked to lie inside the file."""
        with self.path.open("rb") as stream:
            stream.seek(self.info.header_offset)
            raw = stream.read(_LOCAL_HEADER.size)
        if len(raw) < _LOCAL_HEADER.size:
            raise InvalidInput(f"{self.where}: the archive is truncated")
        signature, name_length, extra_length = _LOCAL_HEADER.unpack(raw)
        if signature != b"PK\x03\x04":
            raise InvalidInput(f"{self.where}: the archive's member header is damaged")
        start: int = self.info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        if start + self.info.file_size > archive_size:
            raise InvalidInput(f"{self.where}: the archive is truncated")
        return start

    @property
    def rows(self) -> int:
        return int(self.header.shape[0])

    def empty(self) -> np.ndarray:
        return np.empty((0, *self.header.shape[1:]), dtype=self.header.dtype)

    def array(self) -> np.ndarray:
        with self._lock:
            if self._array is None:
                if self.info.compress_type == zipfile.ZIP_STORED:
                    offset = self.data_start + self.header.size
                    self._array = _mapped(self.path, self.header, offset)
                else:
                    self._array = self._expand()
            return self._array

    def _expand(self) -> np.ndarray:
        scratch = tempfile.TemporaryFile(prefix="sluice-npz-")  # noqa: SIM115 (kept open with the reader)
        written = 0
        try:
            with zipfile.ZipFile(self.path) as archive, archive.open(self.info) as stream:
                stream.read(self.header.size)
                while written < self.header.data_bytes:
                    chunk = stream.read(min(_CHUNK, self.header.data_bytes - written))
                    if not chunk:
                        break
                    written += len(chunk)
                    scratch.write(chunk)
        except _UNREADABLE as exc:
            scratch.close()
            raise InvalidInput(f"{self.where}: the archive is damaged ({exc})") from None
        scratch.flush()
        if written < self.header.data_bytes:
            scratch.close()
            raise InvalidInput(f"{self.where}: the member is shorter than its header claims")
        with scratch:  # (the mapping keeps the data; the file is gone once it is)
            return _mapped(scratch, self.header, 0)


class NpzReader(InputReader):
    def __init__(self, path: Path, config: ModelConfig, limits: InputLimits | None = None) -> None:
        limits = limits or InputLimits()
        with path.open("rb") as stream:
            end_record = zipfile._EndRecData(stream)  # type: ignore[attr-defined]
        if end_record is None:
            raise InvalidInput("'input': not an .npz (zip) archive")
        if end_record[zipfile._ECD_ENTRIES_TOTAL] > _MAX_NPZ_MEMBERS:  # type: ignore[attr-defined]
            raise InvalidInput(
                f"'input': the .npz lists more than {_MAX_NPZ_MEMBERS} arrays; it should "
                "hold one per model input"
            )
        self.specs = {s.name: s for s in config.inputs if not s.optional}
        self.members: dict[str, _NpzMember] = {}
        with zipfile.ZipFile(path) as archive:
            for name, spec in self.specs.items():
                member = _NpzMember(path, archive, name, limits.max_expanded_bytes)
                conform(member.empty(), spec, member.where)
                self.members[name] = member
        lengths = {member.rows for member in self.members.values()}
        if len(lengths) != 1:
            raise InvalidInput("'input': the .npz arrays do not have the same number of rows")
        self.rows = lengths.pop()
        self.row_bytes = sum(
            _row_bytes(m.header.shape, m.header.dtype, self.specs[n])
            for n, m in self.members.items()
        )

    def read(self, start: int, end: int) -> dict[str, np.ndarray]:
        return {
            name: _rows(member.array(), start, end, self.specs[name], f"'input' '{name}'")
            for name, member in self.members.items()
        }


# -- Parquet: the row groups a shard covers, batch by batch -----------------------------


class ParquetReader(InputReader):
    def __init__(self, path: Path, config: ModelConfig, limits: InputLimits | None = None) -> None:
        import pyarrow.parquet as pq

        self.limits = limits or InputLimits()
        # Buffered reads, not the whole column chunk at once: a shard's rows cost a page's
        # memory even inside a huge row group.
        self.file = pq.ParquetFile(path, buffer_size=_CHUNK, pre_buffer=False)
        metadata = self.file.metadata
        self.rows = int(metadata.num_rows)
        if self.rows:  # (decoded: what the column chunks hold uncompressed, per row)
            decoded = sum(
                metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups)
            )
            self.row_bytes = max(1, decoded // self.rows)
        columns = set(self.file.schema_arrow.names)
        self.specs = {s.name: s for s in config.inputs if not s.optional}
        missing = sorted(set(self.specs) - columns)
        if missing:
            raise InvalidInput(f"'input': the Parquet file has no column {missing[0]!r}")
        self.leaves = {
            name: [
                j
                for j in range(metadata.num_columns)
                if metadata.schema.column(j).path.split(".")[0] == name
            ]
            for name in self.specs
        }
        self.starts = []
        offset = 0
        for index in range(self.file.num_row_groups):
            self.starts.append(offset)
            offset += metadata.row_group(index).num_rows

    def _check_group(self, index: int) -> None:
        """A row group's columns must not hold more values than the model's rows can (fixed
        dims), nor expand beyond the bound: checked from the footer, before decoding."""
        group = self.file.metadata.row_group(index)
        for name, spec in self.specs.items():
            values = sum(group.column(j).num_values for j in self.leaves[name])
            where = f"'input' column '{name}'"
            if -1 not in spec.dims and values > group.num_rows * element_count(spec.dims):
                raise InvalidInput(
                    f"{where}: row group {index} holds {values} values for {group.num_rows} "
                    f"rows of dims {list(spec.dims)}"
                )
            itemsize = 8 if spec.datatype == "BYTES" else numpy_dtype(spec.datatype).itemsize
            if values * itemsize > self.limits.max_expanded_bytes:
                raise InvalidInput(
                    f"{where}: row group {index} expands to more than "
                    f"{self.limits.max_expanded_bytes} bytes (SLUICE_BATCH_MAX_EXPANDED_BYTES)"
                )

    def read(self, start: int, end: int) -> dict[str, np.ndarray]:
        import pyarrow as pa

        groups = [
            i
            for i, first in enumerate(self.starts)
            if first < end and first + self.file.metadata.row_group(i).num_rows > start
        ]
        for index in groups:
            self._check_group(index)
        batches = []
        if groups and end > start:
            position = self.starts[groups[0]]
            for batch in self.file.iter_batches(
                batch_size=max(1, min(end - start, _PARQUET_BATCH_ROWS)),
                row_groups=groups,
                columns=list(self.specs),
                use_threads=False,
            ):
                first, position = position, position + batch.num_rows
                if position <= start:
                    continue  # before the shard (same row group)
                batches.append(batch.slice(max(start - first, 0), end - max(first, start)))
                if position >= end:
                    break
        table = (
            pa.Table.from_batches(batches)
            if batches
            else self.file.schema_arrow.empty_table().select(list(self.specs))
        )
        out: dict[str, np.ndarray] = {}
        for name, spec in self.specs.items():
            where = f"'input' column '{name}'"
            try:
                out[name] = conform(_column(table.column(name), spec, where), spec, where)
            except (ValueError, TypeError, pa.ArrowException) as exc:
                raise InvalidInput(f"{where}: {exc}") from None
        return out


def _column(column: Any, spec: TensorSpec, where: str) -> np.ndarray:

    combined = column.combine_chunks()
    if combined.null_count:
        raise InvalidInput(f"{where}: the column has empty (null) values")
    kind = combined.type
    if _is_list(kind):
        flat = _flat_rows(combined, spec)
        if flat is not None:
            return flat
        rows = [
            np.asarray(v, dtype=object if _is_bytes(spec) else None) for v in combined.to_pylist()
        ]
        dims = tuple(spec.dims)
        return (
            np.stack([r.reshape(dims) for r in rows])
            if rows
            else np.zeros((0, *[max(d, 0) for d in dims]))
        )
    values: np.ndarray = combined.to_numpy(zero_copy_only=False)
    if _is_bytes(spec):
        values = np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=object)
    dims = tuple(spec.dims)
    return values.reshape((-1, *dims)) if dims and all(d > 0 for d in dims) else values


def _is_list(kind: Any) -> bool:
    import pyarrow as pa

    return bool(
        pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind) or pa.types.is_large_list(kind)
    )


def _flat_rows(column: Any, spec: TensorSpec) -> np.ndarray | None:
    """A list column whose every row holds the model's fixed dims of numbers, flat, as one
    array: no Python object per value (a row group's values as Python objects take several
    times the bytes a shard is bounded by). None for any other column: the row by row path
    takes it, or names what is wrong with it."""
    import pyarrow as pa
    import pyarrow.compute as pc

    dims = tuple(spec.dims)
    if _is_bytes(spec) or not dims or any(d <= 0 for d in dims) or not len(column):
        return None
    values = column.flatten()
    kind = values.type
    numbers = pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
    if not numbers or values.null_count:
        return None  # (lists of lists, of text, or with empty values)
    lengths = pc.min_max(pc.list_value_length(column)).as_py()
    count = element_count(dims)
    if lengths["min"] != count or lengths["max"] != count:
        return None
    flat: np.ndarray = values.to_numpy(zero_copy_only=False)
    return flat.reshape((len(column), *dims))


def _is_bytes(spec: TensorSpec) -> bool:
    return spec.datatype == "BYTES"


# -- JSON Lines: one request per line, read a shard's lines at a time ------------------


class JsonLinesReader(InputReader):
    """One KServe v2 request per line (:mod:`sluice.batch.jsonl`). The rows are the non-blank
    lines; the file is indexed by the offset of every ``INDEX_EVERY``-th row, so the index
    stays small however many lines there are, and a shard reads its own lines, one at a
    time, each within ``max_line_bytes``."""

    INDEX_EVERY = 1024

    def __init__(self, path: Path, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self.path = path
        self.max_line_bytes = max_line_bytes
        self.checkpoints: list[int] = []
        rows = 0
        with path.open("rb") as stream:
            for offset, _ in non_blank_lines(stream, max_line_bytes):
                if rows % self.INDEX_EVERY == 0:
                    self.checkpoints.append(offset)
                rows += 1
        self.rows = rows

    def read(self, start: int, end: int) -> dict[str, np.ndarray]:
        raise NotImplementedError("JSON Lines are read as whole requests: lines()")

    def lines(self, start: int, end: int) -> Iterator[Any]:
        """The requests of rows ``start`` to ``end``, parsed one at a time as they are
        taken (a bad line fails when it is reached, naming it)."""
        for _, request in self.requests(start, end):
            if isinstance(request, InvalidInput):
                raise request
            yield request

    def requests(self, start: int, end: int) -> Iterator[tuple[int, Any]]:
        """``(line, request)`` for rows ``start`` to ``end`` (``line`` counts from 1),
        parsed one at a time as they are taken; a bad line's request is the InvalidInput
        naming it, so that it fails that row alone."""
        if start >= min(end, self.rows):
            return
        with self.path.open("rb") as stream:
            stream.seek(self.checkpoints[start // self.INDEX_EVERY])
            row = start - start % self.INDEX_EVERY
            for _, raw in non_blank_lines(stream, self.max_line_bytes):
                if row >= start:
                    where = f"'input' line {row + 1}"
                    try:
                        yield row + 1, parse_line(raw, where, self.max_line_bytes)
                    except InvalidInput as exc:
                        yield row + 1, exc
                row += 1
                if row >= end:
                    return


# -- outputs ---------------------------------------------------------------------------


def _fixed_width(name: str, array: np.ndarray) -> np.ndarray:
    """A BYTES output as numpy's fixed-width bytes, loadable without pickle. Refused (for
    Parquet or JSON Lines) where that would lose trailing NUL bytes or pad values of very
    different lengths to many times their size."""
    elements = [bytes(v) if not isinstance(v, str) else v.encode() for v in array.reshape(-1)]
    total = sum(len(v) for v in elements)
    widest = max((len(v) for v in elements), default=0)
    if any(v.endswith(b"\0") for v in elements) or widest * len(elements) > 4 * total + MIB:
        raise InvalidInput(
            f"output '{name}' holds BYTES values that a fixed-width .npy cannot hold exactly: "
            "choose 'options.output_format' parquet"
        )
    return np.array(elements, dtype=f"S{max(widest, 1)}").reshape(array.shape)


def write_part(fmt: str, outputs: dict[str, np.ndarray], path_for: Any) -> dict[str, Path]:
    """Write one shard's outputs; ``path_for(suffix)`` names a scratch file. Returns the
    files by output name (``""`` for a single file holding every output)."""
    if fmt == "npy":
        files: dict[str, Path] = {}
        for name, array in outputs.items():
            path = path_for(f"{safe_name(name)}.npy")
            saved = _fixed_width(name, array) if array.dtype.hasobject else array
            np.save(path, saved, allow_pickle=False)
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
