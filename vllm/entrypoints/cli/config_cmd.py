"""`vllm config`: resolve the engine config for the given flags and show where each value
came from (user / level Ox / platform / derived), without loading any weights."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vllm.engine.arg_utils import EngineArgs


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `vllm config` and the engine flags on `subparsers`."""
    parser = subparsers.add_parser(
        "config", help="show the resolved config and where each value came from",
        description="Resolve the engine config for these flags (e.g. -O1, -cc.mode=3) and print "
        "the table of level-controlled settings with their source and reason.")
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--json", action="store_true",
                        help="print the table as JSON on stdout (summary line on stderr)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Print the summary line, then the provenance table (or JSON with --json).
    Raises ValueError for settings that cannot be resolved (the CLI turns it into an error)."""
    config = EngineArgs.from_cli_args(args).create_engine_config()
    model = model_line(config.model_config)
    if args.json:
        print(config.summary_line(), file=sys.stderr)
        table = config.explain_json()
        snapshot = getattr(config.model_config, "hub_snapshot", None)
        if snapshot is not None:
            table["model_config.hub_commit"] = {"value": snapshot.commit, "source": "hub",
                                                "reason": model}
        print(json.dumps(table, indent=2))
    else:
        print(config.summary_line())
        if model:
            print(model)
        print(config.explain_text())
    return 0


def model_line(model_config: Any) -> str:
    """For a Hugging Face Hub model: the repo, the revision asked for, the commit it resolved
    to and the snapshot folder read (the commit is part of the compile-cache key). Empty for a
    local folder."""
    snapshot = getattr(model_config, "hub_snapshot", None)
    if snapshot is None:
        return ""
    return (f"Model {snapshot.repo_id} from the Hugging Face Hub: revision "
            f"{snapshot.revision_name} = commit {snapshot.commit} (snapshot {snapshot.path})")
