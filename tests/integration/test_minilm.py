"""The sentence-embedding example on a real stack: each step of the ``minilm_embedding``
ensemble (tokenizer, transformer, pooling) answers as the same pipeline in-process, and
the steps chained by the client give the in-process embeddings."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from examples.minilm_reference import ServedPipeline
from sluice.scheduler.executor.redis_server import RedisServer
from tests.integration.conftest import load_examples_builder
from tests.support.stack import Stack

STEPS = ("minilm_tokenizer", "minilm_transformer", "minilm_pooling")
ENSEMBLE = "minilm_embedding"
SENTENCES = [
    "A man is eating food.",
    "",
    "Sluice batches requests from many clients into one model run.",
    "Ünïcödé, emoji 🙂 and CJK 漢字.",
]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("minilm")
    load_examples_builder().build_all(root, models=[*STEPS, ENSEMBLE])
    return root


@pytest.fixture(scope="module")
def pipeline(repository: Path) -> ServedPipeline:
    return ServedPipeline(repository, threads=1)


@pytest.fixture(scope="module")
def stack(repository: Path, redis_server: RedisServer) -> Iterator[Stack]:
    stack = Stack(repository, redis_server.url)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(stack.address) as client:
        yield client


def _tokenize_json(stack: Stack, sentences: list[str]) -> dict[str, np.ndarray]:
    """One request with a [N,1] BYTES tensor in KServe v2 JSON."""
    body = {
        "inputs": [
            {"name": "TEXT", "shape": [len(sentences), 1], "datatype": "BYTES", "data": sentences}
        ]
    }
    response = httpx.post(f"{stack.url}/v2/models/minilm_tokenizer/infer", json=body, timeout=30)
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o for o in response.json()["outputs"]}
    assert set(outputs) == {"input_ids", "attention_mask"}
    for output in outputs.values():
        assert output["datatype"] == "INT64"
    return {
        name: np.array(o["data"], dtype=np.int64).reshape(o["shape"]) for name, o in outputs.items()
    }


def _infer(
    client: httpclient.InferenceServerClient, model: str, inputs: dict[str, np.ndarray], output: str
) -> np.ndarray:
    tensors = []
    for name, array in inputs.items():
        datatype = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32"}[array.dtype]
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    result = client.infer(model, tensors, outputs=[httpclient.InferRequestedOutput(output)])
    answer = result.as_numpy(output)
    assert answer is not None
    return np.asarray(answer)


def test_the_steps_are_ready(stack: Stack) -> None:
    for model in STEPS:
        assert httpx.get(f"{stack.url}/v2/models/{model}/ready").status_code == 200, model


def test_tokenizer_answers_as_in_process(stack: Stack, pipeline: ServedPipeline) -> None:
    served = _tokenize_json(stack, SENTENCES)
    expected = pipeline.tokenize(SENTENCES)
    for name in ("input_ids", "attention_mask"):
        np.testing.assert_array_equal(served[name], expected[name])


def test_tokenizer_handles_an_empty_string(stack: Stack) -> None:
    served = _tokenize_json(stack, [""])
    assert served["input_ids"].tolist() == [[101, 102]]  # [CLS] [SEP]
    assert served["attention_mask"].tolist() == [[1, 1]]


def test_tokenizer_refuses_text_that_is_not_utf8(
    client: httpclient.InferenceServerClient,
) -> None:
    text = np.array([[b"caf\xe9"]], dtype=object)  # Latin-1, not UTF-8
    tensor = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(text, binary_data=True)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("minilm_tokenizer", [tensor])
    assert caught.value.status() == "400"
    assert "input 'TEXT': item 0 is not valid UTF-8" in str(caught.value.message())


def test_concurrent_tokenizer_requests_keep_their_own_tokens(
    stack: Stack, pipeline: ServedPipeline
) -> None:
    """Batched together, requests are padded to the longest of the batch: each one's tokens
    up to its attention mask are its own, and the padding is [PAD] with mask 0."""
    sentences = [f"sentence number {i} " + "word " * i for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda s: _tokenize_json(stack, [s]), sentences))
    for sentence, answer in zip(sentences, answers, strict=True):
        expected = pipeline.tokenize([sentence])["input_ids"][0]
        mask = answer["attention_mask"][0]
        assert mask.sum() == len(expected)
        np.testing.assert_array_equal(answer["input_ids"][0][: len(expected)], expected)
        assert not answer["input_ids"][0][len(expected) :].any() and not mask[len(expected) :].any()


def test_transformer_and_pooling_answer_as_in_process(
    client: httpclient.InferenceServerClient, pipeline: ServedPipeline
) -> None:
    tokens = pipeline.tokenize(SENTENCES)
    states = _infer(client, "minilm_transformer", tokens, "last_hidden_state")
    expected_states = pipeline.hidden_states(tokens)
    assert states.dtype == np.float32 and states.shape == expected_states.shape
    np.testing.assert_allclose(states, expected_states, rtol=1e-4, atol=1e-4)
    inputs = {"last_hidden_state": expected_states, "attention_mask": tokens["attention_mask"]}
    embedding = _infer(client, "minilm_pooling", inputs, "EMBEDDING")
    expected = pipeline.pool(expected_states, tokens["attention_mask"])
    assert embedding.shape == (len(SENTENCES), 384)
    np.testing.assert_allclose(embedding, expected, rtol=1e-5, atol=1e-6)


def test_the_steps_chained_by_the_client_give_the_embeddings(
    stack: Stack, client: httpclient.InferenceServerClient, pipeline: ServedPipeline
) -> None:
    """What the ensemble will do, one request at a time through the three served steps."""
    for sentence in SENTENCES:
        tokens = _tokenize_json(stack, [sentence])
        states = _infer(client, "minilm_transformer", tokens, "last_hidden_state")
        inputs = {"last_hidden_state": states, "attention_mask": tokens["attention_mask"]}
        embedding = _infer(client, "minilm_pooling", inputs, "EMBEDDING")
        expected = pipeline.embed([sentence])
        assert float(embedding[0] @ expected[0]) > 1 - 1e-5, sentence


def test_minilm_ensemble_served(
    stack: Stack, client: httpclient.InferenceServerClient, pipeline: ServedPipeline
) -> None:
    """JSON, one sentence per request and several concurrently (batched by each step), and
    a batch of sentences in one binary request: every embedding as in-process."""
    assert httpx.get(f"{stack.url}/v2/models/{ENSEMBLE}/ready").status_code == 200
    expected = pipeline.embed(SENTENCES)

    def one(sentence: str) -> np.ndarray:
        body = {
            "inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [sentence]}]
        }
        response = httpx.post(f"{stack.url}/v2/models/{ENSEMBLE}/infer", json=body, timeout=30)
        assert response.status_code == 200, response.text
        [output] = response.json()["outputs"]
        assert (output["name"], output["datatype"], output["shape"]) == (
            "EMBEDDING",
            "FP32",
            [1, 384],
        )
        return np.array(output["data"], dtype=np.float32)

    with ThreadPoolExecutor(len(SENTENCES) * 2) as pool:
        answers = list(pool.map(one, SENTENCES * 2))
    for answer, want in zip(answers, [*expected, *expected], strict=True):
        assert float(answer @ want) > 1 - 1e-5

    text = np.array([[s.encode()] for s in SENTENCES], dtype=object)
    tensor = httpclient.InferInput("TEXT", [len(SENTENCES), 1], "BYTES")
    tensor.set_data_from_numpy(text, binary_data=True)
    result = client.infer(ENSEMBLE, [tensor])
    batch = result.as_numpy("EMBEDDING")
    assert batch is not None and batch.shape == (len(SENTENCES), 384)
    assert np.all(np.sum(batch * expected, axis=1) > 1 - 1e-5)

    bad = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    bad.set_data_from_numpy(np.array([[b"\xff"]], dtype=object), binary_data=True)
    with pytest.raises(InferenceServerException) as caught:
        client.infer(ENSEMBLE, [bad])
    assert caught.value.status() == "400"
    assert client.get_model_config(ENSEMBLE)["platform"] == "ensemble"
