"""``python -m jctr.serve``: serve every model of a parameter-server JSON file over HTTP
(KServe v2), ``python -m jctr.serve load`` to write the models' embeddings into the
databases first, or ``python -m jctr.serve request`` to turn raw CSV rows into a request.
A server sent SIGHUP reads its parameter-server file again and takes each model's base and
delta models as the file now names them (the next deltas, or the next day's base:
:meth:`jctr.serving.hps_model.HPSModel.take_chain`), without a restart.

Example::

    python -m jctr.serve load --config ps.json
    python -m jctr.serve --config ps.json --port 8000
    kill -HUP <pid>    # after naming the next delta (or day's base) in ps.json
    python -m jctr.serve request --vocab data/mine/vocab.json --rows new.csv > request.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading

from jctr.config.hps import MODEL_JSON_NAMES, ParameterServerConfig, load_ps_config
from jctr.errors import run_command


def open_models(ps: ParameterServerConfig, *, load: bool = True, log=print):
    """(databases, {name: HPSModel}) for a parameter-server config. With ``load`` (``serve``
    starting) each table is checked in each database and loaded where missing (see
    :meth:`HPSModel.load_databases`); a volatile database that cannot be reached is then
    tolerated when the persistent database holds every row, and tried again meanwhile."""
    from jctr.serving.hps import Databases
    from jctr.serving.hps_model import HPSModel, check_model_files
    from jctr.stores.base import StoreUnavailable

    for i, params in enumerate(ps.models):  # before a database folder is made
        check_model_files(params, where=f"models[{i}]", source=ps.source)
    dbs = Databases(ps.volatile_db, ps.persistent_db, volatile_may_be_down=load)
    models = {}
    try:
        for i, params in enumerate(ps.models):
            models[params.model_name] = HPSModel(params, dbs, where=f"models[{i}]",
                                                 source=ps.source)
        if load:
            for name, model in models.items():
                for table, written in model.load_databases(progress=log).items():
                    if any(written.values()):
                        log(f"[jctr] {name}: {table}: {written['persistent_db']:,} rows into "
                            f"the persistent db, {written['volatile_db']:,} into the volatile "
                            f"db ({ps.volatile_db.type})")
                    else:
                        log(f"[jctr] {name}: {table}: the databases hold this export")
                step = model.restore_dense()
                if step is not None:
                    log(f"[jctr] {name}: dense weights of step {step} from the update stream "
                        "(kept in the databases)")
            if dbs.volatile is None and dbs.volatile_configured:
                if dbs.persistent is None:
                    raise StoreUnavailable(dbs.volatile_error or "volatile_db: down")
                log(f"[jctr] warning: {dbs.volatile_error}; serving from the persistent db "
                    f"({ps.persistent_db.type}), which holds every row of every table, and "
                    f"trying the volatile db again every {dbs.backoff_s:g} s")
                dbs.start_reviving()
        for model in models.values():
            model.start_refresh()
    except BaseException:
        for model in models.values():
            model.close()
        dbs.close()
        raise
    return dbs, models


def start_updates(ps: ParameterServerConfig, dbs, models, log=print):
    """The applier of ``update_source`` (None for type ``null``), started."""
    if ps.update_source.type == "null":
        return None
    from jctr.serving.updates import UpdateApplier

    applier = UpdateApplier(ps.update_source, dbs, models)
    applier.start()
    log(f"[jctr] applying online updates from {ps.update_source.brokers} "
        f"(topics hps_et.<model>.<table>, hps_dense.<model>)")
    return applier


# what a SIGHUP takes of a served model's parameters: its chain of model files
CHAIN_FIELDS = ("sparse_model_files", "network_file", "delta_bundles", "dense_model_file",
                "non_trainable_file")


def settings_changed(ps: ParameterServerConfig, params, model) -> list[str]:
    """The settings of ``params`` (a model as a parameter-server file read again names it)
    and of the file's databases that differ from what ``model`` is served with, by their
    JSON names: a SIGHUP takes the model files only (:data:`CHAIN_FIELDS`)."""
    out = [MODEL_JSON_NAMES.get(f.name, f.name) for f in dataclasses.fields(params)
           if f.name not in CHAIN_FIELDS and getattr(params, f.name) != getattr(model.params,
                                                                                  f.name)]
    if ps.volatile_db != model.dbs.volatile_params:
        out.append("volatile_db")
    if ps.persistent_db != model.dbs.persistent_params:
        out.append("persistent_db")
    return list(dict.fromkeys(out))  # (a model's parameters name the databases too)


def take_models_on_sighup(config: str, models: dict, log=print,
                          wake: threading.Event | None = None) -> threading.Event:
    """On SIGHUP, ``config`` read again and every served model takes the base and delta
    models it names now (on a thread of its own; what fails is said and the model served as
    it was). ``wake``: an event a SIGHUP already set (one that came while the server
    started is taken then). Returns the event a SIGHUP sets."""
    wake = wake or threading.Event()

    def run():
        while True:
            wake.wait()
            wake.clear()
            try:
                ps = load_ps_config(config)
            except Exception as e:  # noqa: BLE001 (said; the server goes on)
                log(f"[jctr] error: SIGHUP: {config}: {e}")
                continue
            named = {params.model_name for params in ps.models}
            for name in sorted(set(models) - named):
                log(f"[jctr] SIGHUP: {config} no longer names model {name}: served until a "
                    "restart")
            for params in ps.models:
                model = models.get(params.model_name)
                if model is None:
                    log(f"[jctr] error: SIGHUP: {config}: model {params.model_name} is not "
                        "served; restart the server to serve it")
                    continue
                changed = settings_changed(ps, params, model)
                if changed:
                    log(f"[jctr] SIGHUP: {params.model_name}: {config} changes "
                        f"{', '.join(changed)}: those take a restart (served with the ones it "
                        "started with)")
                try:
                    new_base, deltas = model.take_chain(params, progress=log)
                except Exception as e:  # noqa: BLE001 (said; served as it was)
                    log(f"[jctr] error: SIGHUP: {params.model_name}: {e}")
                    continue
                if new_base:
                    log(f"[jctr] {params.model_name}: a new base taken "
                        f"({params.sparse_model_files[0]}, ...) with {deltas} delta model(s)")
                elif deltas:
                    log(f"[jctr] {params.model_name}: {deltas} delta model(s) taken; serving "
                        f"{params.delta_bundles[-1]}")

    threading.Thread(target=run, name="hps-sighup", daemon=True).start()
    signal.signal(signal.SIGHUP, lambda signum, frame: wake.set())
    return wake


def _load(args) -> None:
    ps = load_ps_config(args.config)
    dbs, models = open_models(ps, load=False)
    try:
        for name, model in models.items():
            for table, written in model.load_databases(
                    replace=True, progress=lambda line: print(line, flush=True)).items():
                print(f"{name}: {table}: {written['persistent_db']:,} rows into "
                      f"{ps.persistent_db.type}, {written['volatile_db']:,} into "
                      f"{ps.volatile_db.type}")
    finally:
        for model in models.values():
            model.close()
        dbs.close()


def _serve(args, hup: threading.Event | None = None) -> None:
    import uvicorn

    from jctr.serving.server import build_app

    # a SIGHUP while the server starts (loading can take minutes) is taken once it serves,
    # not the end of the process (SIGHUP's default)
    if hup is None:
        hup = threading.Event()
        signal.signal(signal.SIGHUP, lambda signum, frame: hup.set())
    ps = load_ps_config(args.config)
    print(f"[jctr] starting {', '.join(p.model_name for p in ps.models)} from {args.config}: "
          "checking and loading the databases", flush=True)
    dbs, models = open_models(ps, log=lambda line: print(line, flush=True))
    applier = None
    try:
        applier = start_updates(ps, dbs, models)
        take_models_on_sighup(args.config, models, log=lambda line: print(line, flush=True),
                              wake=hup)
        app = build_app(models, applier)
        print(f"[jctr] serving {', '.join(models)} on http://{args.host}:{args.port} "
              "(KServe v2: /v2/models/<name>/infer; metrics: /metrics)", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        if applier is not None:
            applier.close()
        for model in models.values():
            model.close()
        dbs.close()


def _hangup_default(hangup: threading.Event | None) -> None:
    """A command that does not serve ends at SIGHUP, as any command does: SIGHUP's default
    back, and one that came while the process started delivered now."""
    if hangup is None or not hasattr(signal, "SIGHUP"):
        return
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    if hangup.is_set():
        os.kill(os.getpid(), signal.SIGHUP)


def main(argv: list[str] | None = None, *, hangup: threading.Event | None = None) -> int:
    """``python -m jctr.serve``'s commands. ``hangup``: set by a SIGHUP since the process
    started (``jctr/serve.py`` catches it before any import that takes time): the server takes
    it once it serves; ``load`` and ``request`` end at it."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["load"], ["request"]):
        _hangup_default(hangup)
    if argv[:1] == ["request"]:
        from jctr.serving.requests import main as request_main

        return request_main(argv[1:])
    if argv[:1] == ["load"]:
        ap = argparse.ArgumentParser(prog="python -m jctr.serve load",
                                     description="Write every model's sparse model files into "
                                                 "the databases of a parameter-server file.")
        ap.add_argument("--config", required=True, help="parameter-server JSON file")
        ap.add_argument("--debug", action="store_true", help="show tracebacks with errors")
        args = ap.parse_args(argv[1:])
        return run_command(lambda: _load(args), debug=args.debug)
    ap = argparse.ArgumentParser(prog="python -m jctr.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="parameter-server JSON file")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port (8000)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks with errors")
    args = ap.parse_args(argv)
    return run_command(lambda: _serve(args, hangup), debug=args.debug)
