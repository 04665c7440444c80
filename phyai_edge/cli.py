"""`phyai-edge` command line. Each subcommand lives in `phyai_edge/commands/<name>.py`.

A command module defines `HELP` (one line), `add_arguments(parser)` and `main(args) -> int`.
Modules are imported only when their command runs, so `phyai-edge run` on a robot never
imports onnx, matplotlib or the exporter.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

# name -> (module, one-line help). Order is the order `--help` lists them in.
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("phyai_edge.commands.info", "what this machine has: torch, CUDA, GPUs, TensorRT, onnxruntime"),
    "run": ("phyai_edge.commands.run", "the real-time control daemon (fixed-period loop, RTC, ZeroMQ actions)"),
    "listen": ("phyai_edge.commands.listen", "subscribe to a daemon's actions and report rate, gaps and latency"),
    "task": ("phyai_edge.commands.task", "set or show the instruction (prompt) a running daemon's policy follows"),
    "bench": ("phyai_edge.commands.bench", "time a model's stages on a backend and device"),
    "export": ("phyai_edge.commands.export", "build an engine bundle (ONNX, TensorRT, CUDA graph) from a checkpoint"),
    "roofline": ("phyai_edge.commands.roofline", "what bounds the control rate: model, processing, transport or robot"),
    "eval": ("phyai_edge.commands.eval", "replay recorded observations through an engine and compare actions"),
    "serve": ("phyai_edge.commands.serve", "one engine on one GPU serving many robot daemons over ZeroMQ"),
    "sim": ("phyai_edge.commands.sim", "a simulated ALOHA robot process that talks to the daemon over ZeroMQ"),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps a command's description and examples as written, and ends each option's help with
    its default unless the help already says it. Flags (False) and options whose default is None
    or empty say nothing here: their help says what leaving them out means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is False or default is argparse.SUPPRESS
                or default in ("", []) or "default" in text.lower()):
            return action.help
        shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
        # argparse %-formats help strings: a literal % in the value must be doubled.
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


def build_parser(available: dict[str, tuple[str, str]] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phyai-edge",
        description="Run a vision-language-action policy on a robot: export fast engines, run the "
        "fixed-period control daemon, and see what bounds your control rate.",
    )
    from phyai_edge import __version__

    parser.add_argument("--version", action="version", version=f"phyai-edge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in (available or COMMANDS).items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
    return parser


def _available() -> dict[str, tuple[str, str]]:
    """Commands whose module exists in this install."""
    found = {}
    for name, (module_name, help_text) in COMMANDS.items():
        if importlib.util.find_spec(module_name) is not None:
            found[name] = (module_name, help_text)
    return found


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    available = _available()
    parser = build_parser(available)
    # Two passes: the first finds the command, the second parses its own arguments.
    if argv and argv[0] in available:
        module = importlib.import_module(available[argv[0]][0])
        sub = argparse.ArgumentParser(
            prog=f"phyai-edge {argv[0]}",
            description=getattr(module, "DESCRIPTION", available[argv[0]][1]),
            formatter_class=HelpFormatter,
        )
        module.add_arguments(sub)
        args = sub.parse_args(argv[1:])
        try:
            return int(module.main(args) or 0)
        except BrokenPipeError:
            # The reader stopped early (`phyai-edge roofline ... | head`): not a failure of the
            # command. stdout goes to /dev/null so the interpreter's last flush cannot raise again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
    args = parser.parse_args(argv)
    if args.command is None:
        # No command is a usage error (exit 2, like a wrong one): a unit file or script that lost
        # its `run` must not read as a daemon that ran and finished.
        parser.print_help(sys.stderr)
        return 2
    return 0  # unreachable: a known command is handled above


if __name__ == "__main__":
    sys.exit(main())
