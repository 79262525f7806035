"""The `kiln` command. Each subcommand lives beside the code it drives and is imported
only when used, so `kiln operator` never pays for importing torch."""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

# The pip extra each command's imports come from (`pip install 'kiln[engine]'`).
EXTRAS = {"generate": "engine", "serve": "engine", "quantize": "engine", "eval": "engine", "router": "engine",
          "operator": "operator", "crds": "operator", "local": "operator"}

# subcommand -> module defining `add_arguments(parser)` and `run(args) -> int`
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("kiln.engine.cli", "generate text offline with the engine"),
    "serve": ("kiln.engine.server", "run the OpenAI-compatible server"),
    "quantize": ("kiln.engine.quantize_cli", "write a quantized variant of a model as a servable folder"),
    "eval": ("kiln.engine.evaluate", "compare a quantized variant against the unquantized model"),
    "router": ("kiln.router.main", "run the per-service router"),
    "operator": ("kiln.operator.main", "run the Kubernetes operator"),
    "crds": ("kiln.operator.crds", "write the CRD YAML generated from the models"),
    "local": ("kiln.local.cli", "start/stop the local Kubernetes control plane"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        usage = "\n".join(f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items())
        print(f"usage: kiln COMMAND [options]\n\ncommands:\n{usage}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    name, rest = argv[0], argv[1:]
    try:
        module = importlib.import_module(COMMANDS[name][0])
        parser = argparse.ArgumentParser(prog=f"kiln {name}", description=COMMANDS[name][1])
        module.add_arguments(parser)
        args = parser.parse_args(rest)
        return int(module.run(args) or 0)
    except ModuleNotFoundError as e:
        if not e.name or e.name.partition(".")[0] == "kiln":  # our own bug: its traceback is the report
            raise
        # An install without the command's extra (the operator image has no torch).
        print(f"kiln {name}: needs the {EXTRAS[name]} extra (pip install 'kiln[{EXTRAS[name]}]'): "
              f"no module named {e.name!r}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C is the user's choice, not a crash: no traceback
        print(f"\nkiln {name}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT  # the shell's code for a process ended by SIGINT
    except BrokenPipeError:  # stdout's reader went away (`kiln generate ... | head`)
        # Point stdout at /dev/null so the flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
