"""Tree models through a real stack, configured as for Triton's FIL backend: XGBoost (UBJSON
and JSON), LightGBM, and scikit-learn forests as Treelite checkpoints. Every answer equals
the library's own prediction in-process; a bad configuration names what is wrong."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import lightgbm  # the trees extra, part of the dev install: missing fails loudly
import numpy as np
import pytest
import treelite
import treelite.sklearn
import tritonclient.http as httpclient
import xgboost
from sklearn import datasets, ensemble

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.stack import Stack


def _config(name: str, features: int, width: int, model_type: str, **parameters: str) -> str:
    params = {"model_type": model_type, **parameters}
    entries = ",\n".join(
        f'  {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
        for key, value in params.items()
    )
    return (
        f'name: "{name}"\nbackend: "fil"\nmax_batch_size: 1024\n'
        f'input [ {{ name: "input__0" data_type: TYPE_FP32 dims: [ {features} ] }} ]\n'
        f'output [ {{ name: "output__0" data_type: TYPE_FP32 dims: [ {width} ] }} ]\n'
        "instance_group [ { kind: KIND_CPU } ]\n"
        f"parameters [\n{entries}\n]\n"
        "dynamic_batching { max_queue_delay_microseconds: 1000 }\n"
    )


def _write(root: Path, name: str, config: str, filename: str) -> Path:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)
    return root / name / "1" / filename


Case = tuple[np.ndarray, np.ndarray]
"""Rows (float32) and what the model answers for them in-process, as FIL shapes it."""


def _build(root: Path) -> dict[str, Case]:
    iris_x, iris_y = datasets.load_iris(return_X_y=True)
    cancer_x, cancer_y = datasets.load_breast_cancer(return_X_y=True)
    diabetes_x, diabetes_y = datasets.load_diabetes(return_X_y=True)
    iris_x, cancer_x, diabetes_x = (x.astype(np.float32) for x in (iris_x, cancer_x, diabetes_x))
    cases: dict[str, Case] = {}

    booster = xgboost.XGBClassifier(n_estimators=20, max_depth=3, random_state=0)
    booster.fit(iris_x, iris_y)
    booster.save_model(
        _write(
            root,
            "xgb_iris",
            _config("xgb_iris", 4, 3, "xgboost_ubj", output_class="true", predict_proba="true"),
            "xgboost.ubj",
        )
    )
    cases["xgb_iris"] = (iris_x, booster.predict_proba(iris_x))

    binary = xgboost.XGBClassifier(n_estimators=20, max_depth=3, random_state=0)
    binary.fit(cancer_x, cancer_y)
    config = _config("xgb_cancer", 30, 1, "xgboost_json", output_class="true", threshold="0.3")
    binary.save_model(_write(root, "xgb_cancer", config, "xgboost.json"))
    labels = (binary.predict_proba(cancer_x)[:, 1] > 0.3).astype(np.float32)
    cases["xgb_cancer"] = (cancer_x, labels[:, None])

    regressor = xgboost.XGBRegressor(n_estimators=30, max_depth=4, random_state=0)
    regressor.fit(diabetes_x, diabetes_y)
    config = _config("xgb_diabetes", 10, 1, "xgboost_json", output_class="false")
    regressor.save_model(_write(root, "xgb_diabetes", config, "xgboost.json"))
    cases["xgb_diabetes"] = (diabetes_x, regressor.predict(diabetes_x)[:, None])

    light = lightgbm.LGBMClassifier(n_estimators=20, num_leaves=8, random_state=0, verbose=-1)
    light.fit(cancer_x, cancer_y)
    config = _config("lgb_cancer", 30, 2, "lightgbm", output_class="true", predict_proba="true")
    light.booster_.save_model(str(_write(root, "lgb_cancer", config, "model.txt")))
    cases["lgb_cancer"] = (cancer_x, light.predict_proba(cancer_x))

    light_reg = lightgbm.LGBMRegressor(n_estimators=30, num_leaves=8, random_state=0, verbose=-1)
    light_reg.fit(diabetes_x, diabetes_y)
    config = _config("lgb_diabetes", 10, 1, "lightgbm")
    light_reg.booster_.save_model(str(_write(root, "lgb_diabetes", config, "model.txt")))
    cases["lgb_diabetes"] = (diabetes_x, light_reg.predict(diabetes_x)[:, None])

    forest = ensemble.RandomForestClassifier(n_estimators=15, max_depth=5, random_state=0)
    forest.fit(iris_x, iris_y)
    config = _config(
        "sk_forest", 4, 3, "treelite_checkpoint", output_class="true", predict_proba="true"
    )
    treelite.sklearn.import_model(forest).serialize(
        str(_write(root, "sk_forest", config, "checkpoint.tl"))
    )
    cases["sk_forest"] = (iris_x, forest.predict_proba(iris_x))

    gbr = ensemble.GradientBoostingRegressor(n_estimators=30, max_depth=3, random_state=0)
    gbr.fit(diabetes_x, diabetes_y)
    config = _config("sk_gbr", 10, 1, "treelite_checkpoint")
    treelite.sklearn.import_model(gbr).serialize(
        str(_write(root, "sk_gbr", config, "checkpoint.tl"))
    )
    cases["sk_gbr"] = (diabetes_x, gbr.predict(diabetes_x)[:, None])

    # Broken on purpose: each must be unavailable with its reason, the others unharmed.
    _write(root, "no_type", _config("no_type", 4, 3, "catboost"), "model.bin").write_bytes(b"")
    wrong = _config("wrong_features", 5, 3, "xgboost_ubj", output_class="true")
    booster.save_model(_write(root, "wrong_features", wrong, "xgboost.ubj"))
    return cases


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Case]]:
    root = tmp_path_factory.mktemp("trees")
    return root, _build(root)


@pytest.fixture(scope="module")
def stack(built: tuple[Path, dict[str, Case]], redis_server: RedisServer) -> Iterator[Stack]:
    stack = Stack(built[0], redis_server.url)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(stack.address) as client:
        yield client


MODELS = (
    "xgb_iris",
    "xgb_cancer",
    "xgb_diabetes",
    "lgb_cancer",
    "lgb_diabetes",
    "sk_forest",
    "sk_gbr",
)


def _infer(client: httpclient.InferenceServerClient, model: str, rows: np.ndarray) -> Any:
    tensor = httpclient.InferInput("input__0", list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows)
    return client.infer(model, [tensor]).as_numpy("output__0")


@pytest.mark.parametrize("model", MODELS)
def test_served_answers_equal_the_library_in_process(
    client: httpclient.InferenceServerClient,
    built: tuple[Path, dict[str, Case]],
    model: str,
) -> None:
    rows, expected = built[1][model]
    answer = _infer(client, model, rows)
    assert answer.dtype == np.float32 and answer.shape == expected.shape
    np.testing.assert_allclose(answer, expected.astype(np.float32), rtol=1e-4, atol=1e-5)


def test_rows_of_concurrent_requests_are_batched_and_kept_apart(
    client: httpclient.InferenceServerClient, built: tuple[Path, dict[str, Case]], stack: Stack
) -> None:
    rows, expected = built[1]["xgb_iris"]
    with ThreadPoolExecutor(8) as pool:

        def one(index: int) -> np.ndarray:
            with httpclient.InferenceServerClient(stack.address) as own:
                return _infer(own, "xgb_iris", rows[index : index + 1])  # type: ignore[no-any-return]

        answers = list(pool.map(one, range(len(rows))))
    np.testing.assert_allclose(np.concatenate(answers), expected, rtol=1e-4, atol=1e-5)


def test_a_bad_tree_config_is_unavailable_with_its_reason(stack: Stack) -> None:
    index = httpx.post(f"{stack.url}/v2/repository/index", json={}).json()
    reasons = {row["name"]: row.get("reason", "") for row in index}
    assert reasons["xgb_iris"] == ""
    assert "parameter 'model_type' must be one of xgboost_ubj" in reasons["no_type"]
    assert "takes 4 features, the config's 'input__0' declares 5" in reasons["wrong_features"]
