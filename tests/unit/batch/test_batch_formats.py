"""Batch inputs read bounded: ``.npy`` and ``.npz`` headers are checked against the files'
real sizes before anything is mapped, object (pickled) arrays are refused, a compressed
``.npz`` member may not expand beyond its bound, Parquet is read a shard's rows at a time
even inside one huge row group, and outputs are written without pickle."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tracemalloc
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sluice.batch.formats import (
    InputLimits,
    NpyReader,
    NpzReader,
    ParquetReader,
    open_input,
    write_part,
)
from sluice.core.config import ModelConfig, parse_config_text
from sluice.core.errors import InvalidInput

CONFIG_TEXT = """
    name: "m"
    backend: "python"
    max_batch_size: 8
    input [ { name: "input" data_type: TYPE_FP32 dims: [ 16 ] } ]
    output [ { name: "output" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""
CONFIG = parse_config_text(CONFIG_TEXT, model_name="m")
TWO = parse_config_text(
    """
    name: "two"
    backend: "python"
    max_batch_size: 8
    input [
      { name: "a" data_type: TYPE_FP32 dims: [ 16 ] },
      { name: "b" data_type: TYPE_STRING dims: [ 1 ] }
    ]
    output [ { name: "output" data_type: TYPE_FP32 dims: [ 4 ] } ]
    """,
    model_name="two",
)


def _rows(count: int) -> np.ndarray:
    return np.arange(count * 16, dtype=np.float32).reshape(count, 16)


def _refused(
    path: Path, fmt: str, limits: InputLimits | None = None, config: ModelConfig = CONFIG
) -> str:
    with pytest.raises(InvalidInput) as caught:
        open_input(path, fmt, config, "", limits)
    return caught.value.message


# -- .npy ------------------------------------------------------------------------------


def test_npy_rows_are_mapped_and_read_a_shard_at_a_time(tmp_path: Path) -> None:
    np.save(tmp_path / "in.npy", _rows(100).astype(np.float64))
    reader = open_input(tmp_path / "in.npy", "npy", CONFIG, "")
    assert isinstance(reader, NpyReader) and isinstance(reader.array, np.memmap)
    part = reader.read(10, 20)["input"]
    assert part.dtype == np.float32 and part.tolist() == _rows(100)[10:20].tolist()


def test_an_object_npy_is_refused_without_unpickling(tmp_path: Path) -> None:
    np.save(tmp_path / "obj.npy", np.array([[b"x"] * 16] * 2, dtype=object), allow_pickle=True)
    message = _refused(tmp_path / "obj.npy", "npy")
    assert "'input': the array holds Python objects (dtype object)" in message
    assert "only pickle can load" in message


def test_an_npy_header_claiming_more_rows_than_the_file_holds_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "short.npy"
    np.save(path, _rows(1000))
    path.write_bytes(path.read_bytes()[: 128 + 64 * 10])  # the header and 10 rows
    message = _refused(path, "npy")
    assert "the header claims 1000 rows of shape [16] (64000 bytes of float32)" in message
    assert "the file holds 640 bytes of data" in message


def test_a_file_that_is_not_npy_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.npy").write_bytes(b"PK\x03\x04 not numpy at all")
    assert _refused(tmp_path / "x.npy", "npy").startswith("'input': cannot read it as npy")


# -- .npz ------------------------------------------------------------------------------


def test_a_stored_npz_member_is_mapped_where_it_lies(tmp_path: Path) -> None:
    np.savez(tmp_path / "in.npz", input=_rows(50), unrelated=np.zeros(3))
    reader = open_input(tmp_path / "in.npz", "npz", CONFIG, "")
    assert isinstance(reader, NpzReader) and reader.rows == 50
    assert isinstance(reader.members["input"].array(), np.memmap)
    assert reader.read(40, 50)["input"].tolist() == _rows(50)[40:].tolist()


def test_a_compressed_npz_member_is_expanded_once_and_read_by_rows(tmp_path: Path) -> None:
    np.savez_compressed(tmp_path / "in.npz", a=_rows(300), b=np.array([[b"t"]] * 300))
    reader = open_input(tmp_path / "in.npz", "npz", TWO, "")
    first = reader.read(0, 5)
    assert first["a"].tolist() == _rows(300)[:5].tolist()
    assert first["b"].tolist() == [[b"t"]] * 5
    assert reader.read(295, 300)["a"].tolist() == _rows(300)[295:].tolist()


def test_an_npz_bomb_is_refused_from_its_directory(tmp_path: Path) -> None:
    """16 MiB of zeros compress to a few kilobytes; the bound is checked before reading."""
    np.savez_compressed(tmp_path / "bomb.npz", input=np.zeros((1 << 18, 16), dtype=np.float32))
    assert (tmp_path / "bomb.npz").stat().st_size < 100_000
    message = _refused(tmp_path / "bomb.npz", "npz", InputLimits(max_expanded_bytes=1 << 20))
    assert "'input' array 'input' expands to 16777344 bytes, more than 1048576" in message
    assert "SLUICE_BATCH_MAX_EXPANDED_BYTES" in message


def test_an_object_npz_member_is_refused(tmp_path: Path) -> None:
    objects = np.array([[b"x"] * 16] * 2, dtype=object)
    for save in (np.savez, np.savez_compressed):
        save(tmp_path / "obj.npz", input=objects, allow_pickle=True)
        message = _refused(tmp_path / "obj.npz", "npz")
        assert "'input' array 'input': the array holds Python objects" in message


@pytest.mark.parametrize("method", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_an_npz_member_shorter_than_its_header_claims_is_refused(
    tmp_path: Path, method: int
) -> None:
    np.save(tmp_path / "whole.npy", _rows(1000))
    with zipfile.ZipFile(tmp_path / "short.npz", "w", method) as archive:
        archive.writestr("input.npy", (tmp_path / "whole.npy").read_bytes()[:2000])
    message = _refused(tmp_path / "short.npz", "npz")
    assert "'input' array 'input': the header claims 1000 rows" in message


def test_a_truncated_stored_npz_is_refused(tmp_path: Path) -> None:
    np.savez(tmp_path / "in.npz", input=_rows(100))
    data = (tmp_path / "in.npz").read_bytes()
    directory = data.rindex(b"PK\x01\x02")
    # The member's bytes cut short, its directory kept: the member would run past the file.
    (tmp_path / "cut.npz").write_bytes(data[:1000] + data[directory:])
    message = _refused(tmp_path / "cut.npz", "npz")
    assert "cannot read it as npz" in message or "truncated" in message


def test_npz_without_the_input_or_with_too_many_members_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    np.savez(tmp_path / "other.npz", x=_rows(2))
    assert "the .npz has no array 'input' (a model input)" in _refused(
        tmp_path / "other.npz", "npz"
    )
    extra: dict[str, Any] = {f"x{i}": np.zeros(1) for i in range(5)}
    np.savez(tmp_path / "many.npz", input=_rows(2), **extra)
    monkeypatch.setattr("sluice.batch.formats._MAX_NPZ_MEMBERS", 4)
    assert "the .npz lists more than 4 arrays" in _refused(tmp_path / "many.npz", "npz")


def test_npz_arrays_of_different_lengths_are_refused(tmp_path: Path) -> None:
    np.savez(tmp_path / "in.npz", a=_rows(3), b=np.array([[b"t"]] * 4))
    assert "do not have the same number of rows" in _refused(tmp_path / "in.npz", "npz", None, TWO)


# -- Parquet ---------------------------------------------------------------------------


def test_parquet_reads_a_shard_across_row_groups(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input": list(_rows(1000))}), tmp_path / "in.pq", row_group_size=300)
    reader = open_input(tmp_path / "in.pq", "parquet", CONFIG, "")
    assert isinstance(reader, ParquetReader)
    for start, end in ((0, 10), (290, 610), (995, 1000), (0, 1000)):
        assert reader.read(start, end)["input"].tolist() == _rows(1000)[start:end].tolist()


@pytest.mark.slow
def test_a_shard_of_a_huge_row_group_costs_a_page_not_the_group(tmp_path: Path) -> None:
    """One row group of 32 MiB of values; ten rows read from its middle stay far below it
    (measured in a fresh process: the allocator's peak is process-wide)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "big.pq"
    rows = np.random.default_rng(0).standard_normal((1 << 19, 16), dtype=np.float32)
    offsets = pa.array(np.arange(0, rows.size + 1, 16, dtype=np.int32))
    column = pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1)))
    pq.write_table(pa.table({"input": column}), path, row_group_size=1 << 20)
    assert pq.ParquetFile(path).num_row_groups == 1
    script = textwrap.dedent(
        f"""
        import pyarrow as pa
        from sluice.batch.formats import ParquetReader
        from sluice.core.config import parse_config_text
        config = parse_config_text({CONFIG_TEXT!r}, model_name="m")
        reader = ParquetReader({str(path)!r}, config)
        base = pa.default_memory_pool().max_memory()
        part = reader.read(300_000, 300_010)["input"]
        print(part.shape, (pa.default_memory_pool().max_memory() - base) >> 20)
        """
    )
    root = Path(__file__).resolve().parents[3]
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=root, check=True
    )
    shape, peak_mib = run.stdout.rsplit(")", 1)
    assert shape.strip() == "(10, 16"
    assert int(peak_mib) < 8, run.stdout


def test_a_parquet_row_group_holding_more_values_than_its_rows_can_is_refused(
    tmp_path: Path,
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input": [list(range(64))] * 10}), tmp_path / "wide.pq")
    reader = open_input(tmp_path / "wide.pq", "parquet", CONFIG, "")
    with pytest.raises(InvalidInput) as caught:
        reader.read(0, 1)
    assert "'input' column 'input': row group 0 holds 640 values for 10 rows of dims [16]" in (
        caught.value.message
    )


def test_parquet_nulls_and_ragged_rows_are_clean_errors(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input": [list(range(16)), None]}), tmp_path / "null.pq")
    with pytest.raises(InvalidInput, match="empty \\(null\\) values"):
        open_input(tmp_path / "null.pq", "parquet", CONFIG, "").read(0, 2)
    pq.write_table(pa.table({"input": [list(range(16)), list(range(8))]}), tmp_path / "rag.pq")
    with pytest.raises(InvalidInput, match="'input' column 'input': "):
        open_input(tmp_path / "rag.pq", "parquet", CONFIG, "").read(0, 2)


# -- outputs ---------------------------------------------------------------------------


def test_bytes_outputs_are_written_without_pickle(tmp_path: Path) -> None:
    texts = np.array([[b"a"], [b"longer"]], dtype=object)
    files = write_part("npy", {"label": texts}, lambda suffix: tmp_path / suffix)
    loaded = np.load(files["label"], allow_pickle=False)
    assert loaded.tolist() == [[b"a"], [b"longer"]]


def test_bytes_outputs_a_fixed_width_npy_cannot_hold_ask_for_parquet(tmp_path: Path) -> None:
    for values in ([b"ends in nul\0", b"x"], [b"x" * (4 << 20)] + [b""] * 10):
        texts = np.array(values, dtype=object)
        with pytest.raises(InvalidInput, match=r"choose 'options\.output_format' parquet"):
            write_part("npy", {"label": texts}, lambda suffix: tmp_path / suffix)


def test_the_limits_come_from_the_batch_workers_settings() -> None:
    from sluice.core.settings import BatchSettings

    assert InputLimits.of(BatchSettings()) == InputLimits(64 << 20, 8 << 30)
    settings = BatchSettings(batch_max_line_bytes=1000, batch_max_expanded_bytes=2000)
    assert InputLimits.of(settings) == InputLimits(1000, 2000)


def test_a_damaged_compressed_npz_member_is_a_clean_error(tmp_path: Path) -> None:
    rows = np.random.default_rng(1).standard_normal((2000, 16)).astype(np.float32)
    np.savez_compressed(tmp_path / "in.npz", input=rows)
    data = bytearray((tmp_path / "in.npz").read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)
    (tmp_path / "bad.npz").write_bytes(bytes(data))
    with pytest.raises(InvalidInput, match="'input' array 'input': the archive is damaged"):
        open_input(tmp_path / "bad.npz", "npz", CONFIG, "").read(0, 10)


def test_a_parquet_list_column_is_read_without_a_python_object_per_value(
    tmp_path: Path,
) -> None:
    """A shard's rows are bounded in bytes (SLUICE_BATCH_MAX_SHARD_BYTES): a list column
    used to become a Python float per value first, several times those bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = np.random.default_rng(3).standard_normal((20_000, 16)).astype(np.float32)
    offsets = pa.array(np.arange(0, rows.size + 1, 16, dtype=np.int32))
    column = pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1)))
    pq.write_table(pa.table({"input": column}), tmp_path / "in.pq", row_group_size=5_000)
    reader = open_input(tmp_path / "in.pq", "parquet", CONFIG, "")
    reader.read(0, 10)  # (the file's buffers, once)
    tracemalloc.start()
    try:
        part = reader.read(2_500, 17_500)["input"]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(part, rows[2_500:17_500])
    assert peak < 4 * rows[2_500:17_500].nbytes, f"{peak} bytes at the peak"
