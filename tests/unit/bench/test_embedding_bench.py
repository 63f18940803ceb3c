"""bench.embedding_bench: its options, answer checks, table, and the in-process part."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from bench import embedding_bench as bench

BUILD = Path(__file__).resolve().parents[3] / "model_repository" / "build.py"


def test_defaults() -> None:
    args = bench.parse_args([])
    assert args.model == "minilm_embedding"
    assert (args.input, args.output) == ("TEXT", "EMBEDDING")
    assert args.concurrency == [1, 16, 64]
    assert args.threads[0] == 1 and args.threads == sorted(set(args.threads))
    assert args.model_repository == Path("model_repository")
    assert not args.no_served and not args.no_in_process and args.url is None


def test_any_model_and_a_running_server() -> None:
    args = bench.parse_args(
        [
            "--model",
            "minilm_tokenizer",
            "--output",
            "input_ids",
            "--concurrency",
            "2,8",
            "--threads",
            "3",
            "--url",
            "http://127.0.0.1:8000",
        ]
    )
    assert (args.model, args.output, args.concurrency, args.threads) == (
        "minilm_tokenizer",
        "input_ids",
        [2, 8],
        [3],
    )
    assert (args.target.host, args.target.port) == ("127.0.0.1", 8000)


@pytest.mark.parametrize(
    "argv",
    [
        ["--concurrency", "0"],
        ["--duration", "0"],
        ["--batch", "0"],
        ["--no-served", "--no-in-process"],
        ["--url", "http://example.com:8000"],
    ],
)
def test_bad_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_sentences_are_seeded_and_varied() -> None:
    texts = bench.sentences(50)
    assert texts == bench.sentences(50) and len(set(texts)) == 50
    lengths = [len(text.split()) for text in texts]
    assert min(lengths) >= 4 and max(lengths) <= 48 and max(lengths) - min(lengths) > 20


def test_request_body_is_one_sentence_as_bytes() -> None:
    body = json.loads(bench.request_body("héllo"))
    assert body == {
        "inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["héllo"]}]
    }


def test_answers_are_checked() -> None:
    expected = np.array([0.6, 0.8], dtype=np.float32)

    def answer(data: list[float]) -> bytes:
        return json.dumps({"outputs": [{"name": "EMBEDDING", "data": data}]}).encode()

    assert bench.check_answer(answer([0.6, 0.8]), "EMBEDDING", expected) is None
    assert "cosine" in str(bench.check_answer(answer([0.8, 0.6]), "EMBEDDING", expected))
    assert "no output 'other'" in str(bench.check_answer(answer([1.0]), "other", None))
    assert bench.check_answer(answer([1.0]), "EMBEDDING", None) is None
    assert "not a KServe v2 answer" in str(bench.check_answer(b"{}", "EMBEDDING", None))


@pytest.mark.slow
def test_in_process_rows_and_table(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("embedding_build", BUILD)
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    build.build_all(tmp_path, models=["minilm_tokenizer", "minilm_transformer", "minilm_pooling"])
    texts = bench.sentences(6)
    rows, expected = bench.in_process_rows(tmp_path, texts, [1, 4], 0.2, [1])
    assert [row.load for row in rows] == ["batch 1, 1 thread", "batch 4, 1 thread"]
    assert all(row.sentences_per_s > 0 and row.p50_ms is not None for row in rows)
    assert set(expected) == set(texts)
    assert all(vector.shape == (384,) for vector in expected.values())
    table = bench.markdown("minilm_embedding", rows)
    assert "| in-process | batch 4, 1 thread |" in table
    assert table.splitlines()[2].startswith("| path | load | sentences/s | p50 ms | p99 ms |")
