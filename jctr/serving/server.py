"""HTTP inference server speaking the KServe v2 protocol (what Triton Inference Server speaks,
so ``tritonclient.http`` and any KServe v2 client work), with Prometheus metrics.

Endpoints: ``GET /v2/health/live``, ``GET /v2/health/ready`` (503 while a database layer is down
that some keys can only come from, or while the online updates waiting at start are not
applied yet; the body lists each layer), ``GET /v2``,
``GET /v2/models/<name>[/versions/<v>]``, ``GET /v2/models/<name>/ready``,
``GET /v2/models/<name>/config`` (the model configuration, in Triton's JSON form),
``POST /v2/models/<name>[/versions/<v>]/infer`` (JSON, or the binary tensor extension with the
``Inference-Header-Content-Length`` header), ``GET /metrics``.

A model's inputs (its metadata lists them): ``DES`` FP32 ``[n, dense_dim]`` (absent without
dense features) and, per sparse input, ``CATCOLUMN`` INT64 keys with ``ROWINDEX`` INT32/INT64
row offsets ``[n * slot_num + 1]`` (CSR over sample x slot), or ``CATCOLUMN`` shaped
``[n, slot_num]`` without ``ROWINDEX`` (one key per slot). With several sparse inputs the
names carry the input's top: ``CATCOLUMN_<top>``, ``ROWINDEX_<top>``. The output is
``OUTPUT0`` FP32 ``[n, label_dim]``. Requests of any size are cut into ``max_batchsize``
batches. Non-finite dense inputs are refused (400 naming the input and the place); a key that
only a database which does not answer could give fails the request (503 naming the layer),
never a default value in its place; JSON never carries a bare ``NaN``.

Example::

    app = build_app({"dlrm": model})
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import numpy as np

from jctr.data.batch import BatchError, nonfinite_dense
from jctr.serving.hps import LAYERS
from jctr.stores.base import StoreUnavailable, first_beyond_int32
from jctr.version import __version__

DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
          "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
          "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64}
HEADER = "inference-header-content-length"


class RequestError(ValueError):
    """A malformed request (HTTP 400); the message names the input."""


def input_names(model) -> list[tuple[str, str, list[int]]]:
    """(name, datatype, shape) of a served model's inputs."""
    data = model.cfg.data
    out = []
    if data.dense_dim:
        out.append(("DES", "FP32", [-1, data.dense_dim]))
    several = len(data.sparse) > 1
    for sp in data.sparse:
        suffix = f"_{sp.top}" if several else ""
        out.append((f"CATCOLUMN{suffix}", "INT64" if model.params.i64_input_key else "INT32",
                    [-1]))
        out.append((f"ROWINDEX{suffix}", "INT32", [-1]))
    return out


def model_metadata(model) -> dict:
    data = model.cfg.data
    return {"name": model.name, "versions": ["1"], "platform": "jctr_hps",
            "inputs": [{"name": n, "datatype": d, "shape": s} for n, d, s in input_names(model)],
            "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, data.label_dim]}],
            "parameters": {"max_batch_size": model.batch_size,
                           "sparse_inputs": [{"top": sp.top, "slot_num": sp.slot_num,
                                              "one_hot": sp.one_hot,
                                              "max_feature_num_per_sample":
                                                  sp.max_feature_num_per_sample}
                                             for sp in data.sparse]}}


def model_config(model) -> dict:
    """The model's configuration as Triton's ``GET /v2/models/<name>/config`` gives it (the
    JSON form of a ``config.pbtxt``: HugeCTR's HPS backend's inputs and output)."""
    data = model.cfg.data
    inputs = []
    for name, dtype, shape in input_names(model):
        inputs.append({"name": name, "data_type": f"TYPE_{dtype}", "format": "FORMAT_NONE",
                       "dims": [-1] if name.startswith(("CATCOLUMN", "ROWINDEX"))
                       else shape[1:], "is_shape_tensor": False, "optional": False})
    return {"name": model.name, "platform": "", "backend": "jctr_hps",
            "version_policy": {"latest": {"num_versions": 1}},
            "max_batch_size": model.batch_size, "input": inputs,
            "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32",
                        "dims": [data.label_dim], "label_filename": "",
                        "is_shape_tensor": False}],
            "instance_group": [{"name": f"{model.name}_0", "kind": "KIND_CPU", "count": 1}],
            "parameters": {"network_file": {"string_value": model.params.network_file},
                           "dense_file": {"string_value": model.params.dense_model_file},
                           "sparse_files": {"string_value":
                                            ",".join(model.params.sparse_model_files)},
                           "embedding_table_names": {"string_value": ",".join(
                               model.params.embedding_table_names)}}}


MAX_ELEMENTS = 1 << 31  # per input tensor: far beyond any batch, within every index type


def parse_infer_request(body: bytes, header_length: int | None
                        ) -> tuple[dict, dict[str, np.ndarray]]:
    """The request JSON and its input tensors (JSON ``data`` or binary extension)."""
    if header_length is not None:
        if header_length < 0 or header_length > len(body):
            raise RequestError(f"{HEADER} {header_length} does not fit a body of {len(body)} "
                               "bytes")
        head, rest = body[:header_length], body[header_length:]
    else:
        head, rest = body, b""
    try:
        req = json.loads(head)
    except (ValueError, UnicodeDecodeError) as e:
        if header_length is not None:  # the JSON part is cut where the header says
            raise RequestError(f"the first {header_length} bytes of the body ({HEADER}) are "
                               f"not a JSON request header ({e}): is {HEADER} the length of "
                               "the JSON part, in bytes?") from None
        raise RequestError(f"request body is not JSON: {e}") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list):
        raise RequestError('request: expected an object with an "inputs" list')
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for i, inp in enumerate(req["inputs"]):
        if not isinstance(inp, dict) or not isinstance(inp.get("name"), str):
            raise RequestError(f"inputs[{i}]: expected an object with a name")
        name = inp["name"]
        dtype = DTYPES.get(inp.get("datatype"))
        if dtype is None:
            raise RequestError(f"input {name}: datatype {inp.get('datatype')!r} is not one of "
                               f"{', '.join(DTYPES)}")
        shape = inp.get("shape")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0
                                                   for d in shape)):
            raise RequestError(f"input {name}: shape must be a list of non-negative integers")
        count = math.prod(shape)  # Python integers: a huge shape must not wrap around
        if count > MAX_ELEMENTS:
            raise RequestError(f"input {name}: shape {shape} holds {count:,} values; at most "
                               f"{MAX_ELEMENTS:,} per input")
        size = (inp.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or offset + size > len(rest):
                raise RequestError(f"input {name}: binary_data_size {size} runs past the body")
            raw = rest[offset:offset + size]
            offset += size
            if size != count * np.dtype(dtype).itemsize:
                raise RequestError(f"input {name}: {size} bytes for shape {shape} of "
                                   f"{inp['datatype']}")
            arr = np.frombuffer(raw, dtype=dtype).reshape(shape)
        else:
            if "data" not in inp:
                raise RequestError(f"input {name}: no data and no binary_data_size")
            try:
                arr = np.asarray(inp["data"], dtype=dtype)
            except (TypeError, ValueError, OverflowError) as e:
                raise RequestError(f"input {name}: data do not convert to "
                                   f"{inp['datatype']}: {e}") from None
            if arr.size != count:
                raise RequestError(f"input {name}: {arr.size} values for shape {shape}")
            arr = arr.reshape(shape)
        if name in tensors:
            raise RequestError(f"input {name}: given twice")
        tensors[name] = arr
    return req, tensors


def request_features(model, tensors: dict[str, np.ndarray]) -> tuple[np.ndarray, list]:
    """(dense, sparse) for :meth:`HPSModel.predict_features` from the named tensors."""
    data = model.cfg.data
    known = {n for n, _, _ in input_names(model)}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise RequestError(f"input {unknown[0]}: not an input of model {model.name} (inputs: "
                           f"{', '.join(sorted(known))})")
    several = len(data.sparse) > 1
    n = None
    if data.dense_dim:
        if "DES" not in tensors:
            raise RequestError("input DES: missing (dense features, FP32 [n, "
                               f"{data.dense_dim}])")
        des = tensors["DES"]
        if des.ndim == 1 and des.size % data.dense_dim == 0:
            des = des.reshape(-1, data.dense_dim)
        if des.ndim != 2 or des.shape[1] != data.dense_dim:
            raise RequestError(f"input DES: expected shape [n, {data.dense_dim}], got "
                               f"{list(des.shape)}")
        n = des.shape[0]
        bad = nonfinite_dense(des) if des.dtype.kind == "f" else None
        if bad:
            raise RequestError(f"input DES: {bad}")
    sparse = []
    for sp in data.sparse:
        suffix = f"_{sp.top}" if several else ""
        kname, rname = f"CATCOLUMN{suffix}", f"ROWINDEX{suffix}"
        if kname not in tensors:
            raise RequestError(f"input {kname}: missing (keys of input {sp.top})")
        keys = tensors[kname]
        if keys.dtype.kind not in "iu":
            raise RequestError(f"input {kname}: expected integer keys, got {keys.dtype}")
        if not model.params.i64_input_key and first_beyond_int32(keys) is not None:
            raise RequestError(f"input {kname}: keys beyond int32, but the server runs with "
                               "supportlonglong false")
        if rname in tensors:
            offsets = tensors[rname]
            if offsets.dtype.kind not in "iu" or offsets.ndim != 1 or offsets.size < 1:
                raise RequestError(f"input {rname}: expected integer row offsets [n * "
                                   f"{sp.slot_num} + 1]")
            if (offsets.size - 1) % sp.slot_num:
                raise RequestError(f"input {rname}: {offsets.size} offsets; expected n * "
                                   f"{sp.slot_num} + 1")
            rows = (offsets.size - 1) // sp.slot_num
            sparse.append((keys.reshape(-1).astype(np.int64), offsets.astype(np.int64)))
        else:
            if keys.ndim != 2 or keys.shape[1] != sp.slot_num:
                raise RequestError(f"input {rname}: missing; without it {kname} must be "
                                   f"[n, {sp.slot_num}] (one key per slot), got "
                                   f"{list(keys.shape)}")
            rows = keys.shape[0]
            sparse.append(keys.astype(np.int64))
        if n is None:
            n = rows
        elif rows != n:
            raise RequestError(f"input {rname if rname in tensors else kname}: {rows} samples, "
                               f"but {'DES' if data.dense_dim else 'another input'} has {n}")
    if n is None:
        raise RequestError("request: no inputs")
    dense = tensors.get("DES", np.zeros((n, 0), np.float32))
    if dense.ndim == 1:
        dense = dense.reshape(n, -1)
    return dense, sparse


def infer_response(model, req: dict, pred: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """Response body and headers: JSON, or the binary extension where the request asked."""
    out = np.ascontiguousarray(pred.reshape(pred.shape[0], -1), np.float32)
    if not np.isfinite(out).all():
        rows = np.flatnonzero(~np.isfinite(out).all(axis=1))
        raise ValueError(f"the model predicted non-finite values for {rows.size} sample(s) "
                         f"(the first: sample {int(rows[0])}); the bundle's weights or the "
                         "inputs are out of range")
    binary = bool((req.get("parameters") or {}).get("binary_data_output"))
    for o in req.get("outputs") or []:
        if isinstance(o, dict) and o.get("name") == "OUTPUT0":
            binary = bool((o.get("parameters") or {}).get("binary_data", binary))
    entry: dict[str, Any] = {"name": "OUTPUT0", "datatype": "FP32", "shape": list(out.shape)}
    head = {"model_name": model.name, "model_version": "1", "outputs": [entry]}
    if "id" in req:
        head["id"] = req["id"]
    if not binary:
        entry["data"] = out.reshape(-1).tolist()
        return json.dumps(head, allow_nan=False).encode(), {"content-type": "application/json"}
    raw = out.tobytes()
    entry["parameters"] = {"binary_data_size": len(raw)}
    text = json.dumps(head, allow_nan=False).encode()
    return text + raw, {"content-type": "application/octet-stream",
                        HEADER: str(len(text))}


class Metrics:
    """Prometheus metrics of one server: requests, latency, samples, and the models'
    per-layer lookups, cache hit rate and capacity."""

    def __init__(self, models: dict, updates=None):
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.registry = CollectorRegistry()
        self.requests = Counter("jctr_requests", "inference requests", ["model", "status"],
                                registry=self.registry)
        self.samples = Counter("jctr_samples", "samples predicted", ["model"],
                               registry=self.registry)
        self.latency = Histogram("jctr_request_latency_seconds", "request latency",
                                 ["model"], registry=self.registry,
                                 buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5,
                                          1, 2, 5))

        class Tables:
            def collect(self_inner):
                lookups = CounterMetricFamily("jctr_embedding_lookups",
                                              "distinct keys resolved per layer",
                                              labels=["model", "table", "layer"])
                hit = GaugeMetricFamily("jctr_cache_hit_rate",
                                        "device cache hits / distinct keys queried",
                                        labels=["model", "table"])
                cap = GaugeMetricFamily("jctr_cache_capacity_rows", "device cache rows",
                                        labels=["model", "table"])
                for name, model in models.items():
                    for table, s in model.stats().items():
                        for layer in LAYERS:
                            lookups.add_metric([name, table, layer], s[layer])
                        hit.add_metric([name, table], s["hit_rate"])
                        cap.add_metric([name, table], s["cache_capacity"])
                unanswered = CounterMetricFamily(
                    "jctr_unanswered_batches", "batches refused because a database layer "
                    "that held their keys did not answer", labels=["model", "table"])
                up = GaugeMetricFamily("jctr_store_up", "database layer answering (1) or "
                                       "not (0)", labels=["layer"])
                for name, model in models.items():
                    for table, s in model.stats().items():
                        unanswered.add_metric([name, table], s["unanswered"])
                for layer, state in _health(models).items():
                    up.add_metric([layer], 1.0 if state == "up" else 0.0)
                write_back = CounterMetricFamily(
                    "jctr_write_back_failures", "rows the persistent database found that could "
                    "not be cached in the volatile one (cache_missed_embeddings)")
                write_back.add_metric([], sum({id(m.dbs): m.dbs.write_back_failures
                                               for m in models.values()}.values()))
                yield lookups
                yield hit
                yield cap
                yield unanswered
                yield up
                yield write_back
                if updates is not None:
                    st = updates.stats()
                    applied = CounterMetricFamily("jctr_updates_applied", "online updates "
                                                  "applied to every layer (rows, dense, "
                                                  "erased: keys forgotten) and "
                                                  "served (rows_served, dense_served: the "
                                                  "serving side, ahead of the persistent "
                                                  "database's)", labels=["kind"])
                    applied.add_metric(["rows"], st["applied_rows"])
                    applied.add_metric(["dense"], st["applied_dense"])
                    applied.add_metric(["erased"], st["applied_erased"])
                    applied.add_metric(["rows_served"], st["served_rows"])
                    applied.add_metric(["dense_served"], st["served_dense"])
                    refused = CounterMetricFamily(
                        "jctr_updates_refused", "online updates that can never apply, "
                        "skipped (dense: messages; rows: rows)", labels=["reason"])
                    for reason, n in st["refused"].items():
                        refused.add_metric([reason], n)
                    failed = CounterMetricFamily("jctr_updates_failures", "failed writes of "
                                                 "online updates (retried)")
                    failed.add_metric([], st["failures"])
                    expired = CounterMetricFamily(
                        "jctr_updates_expired", "update messages the broker deleted (the "
                        "topic's retention) before this server read them (messages: counted "
                        "at start; jumps: the client's skips while it read, count unknown)",
                        labels=["kind"])
                    expired.add_metric(["messages"], st["expired_messages"])
                    expired.add_metric(["jumps"], st["expired_jumps"])
                    backlog = GaugeMetricFamily(
                        "jctr_updates_backlog", "update messages the broker holds that the "
                        "serving side has not read yet (the last fetch's high watermarks)")
                    backlog.add_metric([], st["backlog"])
                    yield applied
                    yield refused
                    yield failed
                    yield expired
                    yield backlog

        self.registry.register(Tables())

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def _health(models: dict) -> dict[str, str]:
    """Each database layer's state (the models of one server share their databases)."""
    out: dict[str, str] = {}
    for model in models.values():
        out.update(model.dbs.health())
    return out


def _ready(models: dict) -> bool:
    return all(model.dbs.ready() for model in models.values())


def build_app(models: dict, updates=None):
    """The Starlette application serving ``models`` ({name: HPSModel}); ``updates``: their
    :class:`jctr.serving.updates.UpdateApplier`, whose counts join ``/metrics``."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    metrics = Metrics(models, updates)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    def find(request: Request):
        name = request.path_params["name"]
        version = request.path_params.get("version")
        if name not in models or version not in (None, "1"):
            return None, error(404, f"model {name!r}" + (f" version {version!r}" if version
                                                          else "") + " is not served here ("
                               f"models: {', '.join(sorted(models))})")
        return models[name], None

    async def live(request):
        return JSONResponse({"live": True})

    def caught_up() -> bool:  # the online updates waiting at start are applied
        return updates is None or updates.caught_up

    async def ready(request):
        ok = _ready(models) and caught_up()
        body = {"ready": ok, "layers": _health(models)}
        if updates is not None:
            body["updates_caught_up"] = updates.caught_up
            body["update_source"] = "ok" if updates.error is None else updates.error
            messages, jumps = updates.expired
            if messages or jumps:  # still ready: older rows beat none, but it is said
                body["updates_expired"] = {"messages": messages, "jumps": jumps}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def server_meta(request):
        return JSONResponse({"name": "jctr", "version": __version__,
                             "extensions": ["binary_tensor_data"]})

    async def model_meta(request):
        model, err = find(request)
        return err or JSONResponse(model_metadata(model))

    async def model_ready(request):
        model, err = find(request)
        if err:
            return err
        ok = model.dbs.ready() and caught_up()
        return JSONResponse({"name": model.name, "ready": ok, "layers": model.dbs.health()},
                            status_code=200 if ok else 503)

    async def model_config_route(request):
        model, err = find(request)
        return err or JSONResponse(model_config(model))

    async def infer(request):
        model, err = find(request)
        if err:
            return err
        start = time.perf_counter()
        body = await request.body()
        status = "ok"
        try:
            header = request.headers.get(HEADER)
            try:
                header_length = None if header is None else int(header)
            except ValueError:
                raise RequestError(f"{HEADER}: expected an integer, got {header!r}") from None
            req, tensors = parse_infer_request(body, header_length)
            dense, sparse = request_features(model, tensors)
            pred = await run_in_threadpool(model.predict_features, dense, sparse)
            content, headers = infer_response(model, req, pred)
            metrics.samples.labels(model.name).inc(pred.shape[0])
            return Response(content, headers=headers)
        except (RequestError, BatchError) as e:
            status = "bad_request"
            return error(400, str(e))
        except StoreUnavailable as e:
            status = "unavailable"
            return error(503, f"embedding lookup failed: {e}")
        except Exception as e:  # noqa: BLE001 - a server answers, it does not die
            status = "error"
            return error(500, f"{type(e).__name__}: {e}")
        finally:
            metrics.requests.labels(model.name, status).inc()
            metrics.latency.labels(model.name).observe(time.perf_counter() - start)

    async def prometheus(request):
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v2/health/live", live), Route("/v2/health/ready", ready),
        Route("/v2", server_meta),
        Route("/v2/models/{name}", model_meta),
        Route("/v2/models/{name}/versions/{version}", model_meta),
        Route("/v2/models/{name}/ready", model_ready),
        Route("/v2/models/{name}/config", model_config_route),
        Route("/v2/models/{name}/versions/{version}/config", model_config_route),
        Route("/v2/models/{name}/versions/{version}/ready", model_ready),
        Route("/v2/models/{name}/infer", infer, methods=["POST"]),
        Route("/v2/models/{name}/versions/{version}/infer", infer, methods=["POST"]),
        Route("/metrics", prometheus),
    ]
    app = Starlette(routes=routes)
    app.state.metrics = metrics
    return app
