"""The ``jctr`` command: one entry point whose subcommands are the ``python -m`` commands.

    jctr train --config configs/dlrm.json      # = python -m jctr.train
    jctr export --checkpoint ... --output ...  # = python -m jctr.export
    jctr serve --config ps.json                # = python -m jctr.serve
    jctr --version

Nothing heavy is imported before a subcommand is chosen: ``jctr --help`` and ``jctr --version``
answer without starting JAX.
"""

from __future__ import annotations

import sys

# subcommand -> (module with main(argv), one line of help); _command_main imports it
COMMANDS = {
    "train": ("jctr.train.cli", "train from a HugeCTR-style JSON config"),
    "export": ("jctr.serving.export", "write an inference bundle from a checkpoint"),
    "serve": ("jctr.serving.cli", "serve models from the parameter server over HTTP "
                                  "(serve load: fill its databases)"),
    "online": ("jctr.online.cli", "streaming training, pass by pass over time-sliced "
                                  "folders"),
    "report": ("jctr.train.report", "write report.html (plots, summary, config) of a run"),
    "synth": ("jctr.data.tools.synthetic", "generate a power-law synthetic dataset"),
    "convert": ("jctr.data.tools.criteo",
                "convert Criteo TSV files to the Norm / Raw / Parquet formats"),
    "from-csv": ("jctr.data.tools.from_csv", "turn any CSV/TSV into training data and a config"),
    "transcode": ("jctr.data.tools.transcode", "CSV to the feature-spec split binary format"),
    "gen-csv": ("jctr.data.tools.gen_csv", "generate a CSV dataset with a feature spec"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: jctr [--version] [--help] COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "jctr COMMAND --help shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from jctr.version import __version__

        print(f"jctr {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"jctr: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if name == "train":  # as python -m jctr.train (malloc tuning, leaving a cluster)
        from jctr.train.cli import console_main

        return console_main(rest)
    if name == "online":  # as python -m jctr.online (malloc tuning)
        from jctr.online.cli import console_main as online_main

        return online_main(rest)
    return int(_command_main(name)(rest) or 0)


def _command_main(name: str):
    """The subcommand's ``main`` (imported only now: the others' dependencies stay unloaded)."""
    if name == "export":
        from jctr.serving.export import main
    elif name == "serve":
        from jctr.serving.cli import main
    elif name == "report":
        from jctr.train.report import main
    elif name == "synth":
        from jctr.data.tools.synthetic import main
    elif name == "convert":
        from jctr.data.tools.criteo import main
    elif name == "from-csv":
        from jctr.data.tools.from_csv import main
    elif name == "transcode":
        from jctr.data.tools.transcode import main
    elif name == "online":
        from jctr.online.cli import main
    else:
        from jctr.data.tools.gen_csv import main
    return main


if __name__ == "__main__":
    sys.exit(main())
